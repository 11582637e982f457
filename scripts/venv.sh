# Sourced by scripts/up.sh and scripts/test.sh: the one definition of the project's virtual environment.
# Both scripts install into it and never into the Python found on PATH: Debian 12+ and Ubuntu 23.04+ refuse
# `pip install` outside a venv (PEP 668, `externally-managed-environment`), and elsewhere a global install
# would mix rsb's pins with the user's own packages.
#   usage: rsb_venv ROOT    creates the venv if needed; sets rsb_venv_dir and rsb_py (its python)
# RSB_VENV moves it (default ROOT/.venv). The venv is made by the first `python3` on PATH (RSB_PYTHON to
# choose another); on Debian/Ubuntu that needs the python3-venv package, which scripts/test.sh installs when
# it runs as root.
rsb_venv() {
  local root=$1
  local venv=${RSB_VENV:-$root/.venv}
  local python=${RSB_PYTHON:-python3}
  # A venv whose python no longer runs (its interpreter was upgraded or removed) is made again.
  if [ -x "$venv/bin/python" ] && ! "$venv/bin/python" -c 'import sys' 2>/dev/null; then
    echo "rsb: $venv is broken (its python does not run); making it again"
    rm -rf "$venv"
  fi
  if [ ! -x "$venv/bin/python" ]; then
    echo "rsb: creating $venv with $("$python" -c 'import sys; print(sys.executable)' 2>/dev/null || echo "$python")"
    # A failed attempt (no ensurepip) leaves a venv without pip behind: remove it so the next run retries.
    if ! "$python" -m venv "$venv"; then
      rm -rf "$venv"
      echo "rsb: '$python -m venv' failed (Debian/Ubuntu: apt-get install python3-venv)" >&2
      return 1
    fi
  fi
  rsb_venv_dir=$venv
  rsb_py=$venv/bin/python
}
