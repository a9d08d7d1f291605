"""Builds a tiny random-weight Llama and a locally trained tokenizer: no hub, no download.

`python -m kvcr_bench.tiny_model OUT_DIR [--preset test|bench]` writes a folder vLLM loads
with HF_HUB_OFFLINE=1. Presets: `test` is 3.4 M parameters (fast engine start);
`bench` is sized so a 4k-token prefill takes seconds on a 2-core CPU, with large KV per token
(so the load path, not the MLP, is what a reuse benchmark measures). Deterministic: the same
preset gives the same weights and vocabulary. Idempotent: an existing complete folder is kept.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "test": {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 64, "max_position_embeddings": 4096, "dtype": "float32"},
    "bench": {"vocab_size": 8192, "hidden_size": 1024, "intermediate_size": 2048,
              "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8,
              "head_dim": 128, "max_position_embeddings": 8192, "dtype": "float32"},
}
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
_DONE = "kvcr-tiny-model.json"


def _corpus_files() -> list[str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))[:160]
    files += sorted(glob.glob("/usr/share/common-licenses/*"))[:25]
    return [f for f in files if os.path.isfile(f)]


def build(out_dir: str | os.PathLike[str], preset: str = "test") -> Path:
    """Writes the model folder (unless already complete) and returns its path."""
    out = Path(out_dir)
    spec = PRESETS[preset]
    marker = out / _DONE
    if marker.exists() and json.loads(marker.read_text()) == {"preset": preset, **spec}:
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    out.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec["vocab_size"], special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train(_corpus_files(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>",
                                   model_max_length=spec["max_position_embeddings"])
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"], head_dim=spec["head_dim"],
        max_position_embeddings=spec["max_position_embeddings"], tie_word_embeddings=False,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id, torch_dtype=spec["dtype"])  # type: ignore[call-arg]
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.05)  # larger than the default init: varied greedy output
    model = model.to(getattr(torch, spec["dtype"]))
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                     pad_token_id=fast.pad_token_id).save_pretrained(out)
    marker.write_text(json.dumps({"preset": preset, **spec}))
    return out


def build_lora(out_dir: str | os.PathLike[str], preset: str = "test", *, seed: int = 1,
               rank: int = 8) -> Path:
    """A LoRA adapter for the `preset` model, in PEFT's format (adapter_config.json and
    adapter_model.safetensors, random weights from `seed` on q_proj and v_proj), as vLLM
    loads one with `enable_lora`. Rebuilt only if missing."""
    import torch
    from safetensors.torch import save_file

    spec = PRESETS[preset]
    out = Path(out_dir)
    if (out / "adapter_model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    hidden, head_dim = spec["hidden_size"], spec["head_dim"]
    outputs = {"q_proj": spec["num_attention_heads"] * head_dim,
               "v_proj": spec["num_key_value_heads"] * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec["num_hidden_layers"]):
        for name, width in outputs.items():
            base = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.1
            tensors[f"{base}.lora_B.weight"] = torch.randn(width, rank, generator=gen) * 0.1
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "lora_dropout": 0.0, "target_modules": sorted(outputs), "bias": "none",
        "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False,
        "use_dora": False, "base_model_name_or_path": preset}))
    return out


IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]


def build_idefics3(out_dir: str | os.PathLike[str], base_dir: str | os.PathLike[str]) -> Path:
    """A tiny vision-language model (Idefics3: the `test` preset's Llama as its text model,
    a 2-layer 64x64 vision tower, 4 image tokens per image, random weights, PIL image
    processing) beside the `test` model built in `base_dir`. Rebuilt only if missing."""
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        LlamaConfig,
        PreTrainedTokenizerFast,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    out = Path(out_dir)
    if (out / "model.safetensors").exists():
        return out
    base = build(base_dir, "test")
    tok = PreTrainedTokenizerFast.from_pretrained(base)
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    text = LlamaConfig.from_pretrained(base)
    text.vocab_size = len(tok)
    config = Idefics3Config(
        text_config=text.to_dict(), scale_factor=2, pad_token_id=tok.pad_token_id,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "image_size": 64, "patch_size": 16,
                       "num_channels": 3})
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.05)
    model.save_pretrained(out, safe_serialization=True)
    images = Idefics3ImageProcessorPil(size={"longest_edge": 64}, do_image_splitting=False,
                                       max_image_size={"longest_edge": 64})
    Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_gemma3(out_dir: str | os.PathLike[str], base_dir: str | os.PathLike[str], *,
                 sliding_window: int = 64) -> Path:
    """A tiny hybrid-attention model (`Gemma3ForCausalLM`: hidden size 256, 4 layers
    alternating a `sliding_window`-token window and full attention, so vLLM gives it two KV
    cache groups) with the `test` model's tokenizer, built in `base_dir`. Random weights.
    Rebuilt only if missing."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, PreTrainedTokenizerFast

    out = Path(out_dir)
    if (out / "model.safetensors").exists():
        return out
    base = build(base_dir, "test")
    tok = PreTrainedTokenizerFast.from_pretrained(base)
    spec = PRESETS["test"]
    building = out.with_name(f"{out.name}.building-{os.getpid()}")  # renamed when complete:
    # a concurrent builder (another test process) never sees a half-written folder
    config = Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"], num_hidden_layers=4,
        num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"], head_dim=spec["head_dim"],
        query_pre_attn_scalar=spec["head_dim"], sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=spec["max_position_embeddings"], tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, dtype="float32")
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():  # small embeddings (Gemma scales them up): attention sways outputs
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.01 if "embed" in name else 0.1)
    model.save_pretrained(building, safe_serialization=True)
    tok.save_pretrained(building)
    try:
        building.rename(out)
    except OSError:  # another process finished first: its folder is the same model
        shutil.rmtree(building, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="test")
    args = ap.parse_args(argv)
    print(build(args.out_dir, args.preset))
    return 0


if __name__ == "__main__":
    sys.exit(main())
