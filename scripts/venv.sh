# Sourced by the setup scripts: a virtual environment made once, and a stamp that lets a
# script skip its install step when the inputs it hashes did not change.

# make_venv DIR LABEL: creates the venv DIR (with $PYTHON, default python3) unless it exists.
make_venv() {
  if [ ! -x "$1/bin/python" ]; then
    echo "$2: creating $1"
    "${PYTHON:-python3}" -m venv "$1"
  fi
}

# stamp_is DIR HASH: true when the venv DIR was last set up for HASH.
stamp_is() {
  [ -f "$1/.kvcr-setup-stamp" ] && [ "$(cat "$1/.kvcr-setup-stamp")" = "$2" ]
}

# done_if_stamped DIR HASH LABEL: ends the calling script when DIR is set up for HASH.
done_if_stamped() {
  if stamp_is "$1" "$2"; then
    echo "$3: $(basename "$1") is up to date"
    exit 0
  fi
}

# stamp DIR HASH: records that the venv DIR is set up for HASH.
stamp() {
  echo "$2" > "$1/.kvcr-setup-stamp"
}
