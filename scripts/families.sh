# Sourced by scripts/recipe_eagle3.sh and scripts/compare_families.sh: which families a script may train, and the
# overrides each one takes. Not run on its own.

# registered_families: every family in heads/registry.py with a trainer (train/<f>.py) and a recipe
# (conf/experiment/<f>_full.yaml), in registry order
registered_families() {
  python - <<'PY'
from pathlib import Path
from draftheads.heads.registry import FAMILIES
print(" ".join(f for f in FAMILIES if Path(f"train/{f}.py").is_file() and Path(f"conf/experiment/{f}_full.yaml").is_file()))
PY
}

# check_families F...: each F has a trainer and a recipe, else one line naming the allowed ones and exit 2
check_families() {
  local f
  for f in "$@"; do
    [ -f "train/$f.py" ] && [ -f "conf/experiment/${f}_full.yaml" ] || {
      echo "FAMILIES: '$f' is not a family with a trainer and a +experiment=${f}_full recipe; allowed: $(registered_families)" >&2
      exit 2; }
  done
}

# family_args F DEFAULT: the overrides for family F, ${F^^}_ARGS when set (even empty), else DEFAULT
family_args() {
  local v="${1^^}_ARGS"
  if [ -n "${!v+x}" ]; then echo "${!v}"; else echo "${2:-}"; fi
}
