"""Publish a trained head: write a Hub-ready folder and (only when asked) upload it.

    python scripts/publish.py checkpoint=runs/<run>/final                                    # dry run
    python scripts/publish.py checkpoint=runs/<run>/final push=true dry_run=false repo_id=me/heads

The folder holds ``model.safetensors`` + ``config.json`` (the head, byte-identical to the checkpoint,
so our loaders read it back), ``README.md`` (model card: target id and revision, draft family and
config, training data and config, the measured τ table), ``training_config.yaml`` (the run's resolved
config), ``training_summary.json`` and ``tau_table.json`` (every eval/acceptance.py result given).

Before anything is uploaded the folder is validated: required files present, the card's metadata
parses, the weights equal the checkpoint's, and (``verify_load``) the family's own loader loads the
folder on its target. ``dry_run=true`` (the default) stops there: no network at all. Uploading uses
``huggingface_hub`` (``create_repo`` + ``upload_folder``); the token comes from ``HF_TOKEN`` or a cached
``huggingface-cli login`` and is never read, printed or logged by this script.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

REPO = Path(__file__).resolve().parents[1]

from draftheads.heads import job, outputs  # noqa: E402
from draftheads.heads import registry  # noqa: E402
import torch  # noqa: E402

from draftheads.heads.checkpoint import atomic_dir, read_head, save_safetensors  # noqa: E402
from draftheads.heads.target import EMBEDDED_TARGETS  # noqa: E402
from draftheads.scripts.tau_table import file_sha256, read_json, tau_rows  # noqa: E402

log = logging.getLogger(__name__)

REQUIRED_FILES = ("model.safetensors", "config.json", "README.md", "training_config.yaml", "tau_table.json")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_id_of(target: dict[str, Any]) -> str | None:
    """The Hub id of the target, when it has one (embedded targets map to the model they were converted from)."""
    name = str(target.get("name") or "")
    if name in EMBEDDED_TARGETS:
        return EMBEDDED_TARGETS[name].hub_id
    if HUB_ID.match(name) and not Path(name).exists():
        return name
    return None


def license_of(license_id: str, target: dict[str, Any]) -> tuple[str, str | None]:
    """The card's license and notice: ``auto`` takes the embedded target's terms (a draft trained on a target's
    states inherits them: Gemma's for gemma3-270m), and ``other`` for a target whose terms we cannot know."""
    entry = EMBEDDED_TARGETS.get(str(target.get("name") or ""))
    if entry is None:
        return ("other" if license_id == "auto" else license_id), None
    return (entry.license if license_id == "auto" else license_id), entry.notice


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def cast_floats(tensors: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """Floating tensors cast to ``dtype`` (halves a head's size in bf16); integer maps (d2t/t2d) kept as they are."""
    if dtype not in DTYPES:
        raise ValueError(f"publish dtype={dtype!r} is not one of {', '.join(DTYPES)} (or null: as trained)")
    return {k: (v.to(DTYPES[dtype]) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}


def _metadata(path: Path) -> dict[str, str] | None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def git_commit() -> str | None:
    """The draftheads commit this runs from (None outside a git checkout)."""
    import subprocess

    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _title(family: str) -> str:
    """The registered family's model-card title ("EAGLE-3 draft"); its name for an unknown or untitled one."""
    f = registry.FAMILIES.get(family)
    return (f.title if f else "") or family


def model_card(head_cfg: dict[str, Any], run_cfg: dict[str, Any] | None, summary: dict[str, Any] | None,
               taus: list[dict[str, Any]], license_id: str, n_params: int, weights_dtype: str | None = None,
               made_by: str | None = None, commit: str | None = None) -> str:
    """README.md with Hub metadata (YAML front matter) and the facts a user of the head needs."""
    import yaml

    family = head_cfg.get("family", "?")
    tgt = head_cfg.get("target", {})
    base = hub_id_of(tgt)
    license_id, notice = license_of(license_id, tgt)
    meta: dict[str, Any] = {"library_name": "draftheads", "license": license_id,
                            "tags": ["speculative-decoding", "draft-model", family, "draftheads"]}
    if base:
        meta["base_model"] = base
    data = head_cfg.get("data") or {}
    title = f"{_title(family)} for {base or tgt.get('name')}"
    L = ["---", yaml.safe_dump(meta, sort_keys=True).strip(), "---", "", f"# {title}", "",
         f"Speculative-decoding draft ({family}) trained with draftheads for a **frozen** target. "
         f"It proposes tokens; the target verifies them, so greedy output is token-identical to the target's.", "",
         "## Target", "", "| field | value |", "|---|---|"]
    for k in ("name", "revision", "fingerprint", "model_type", "vocab_size", "hidden_size", "num_layers"):
        L.append(f"| {k} | `{tgt.get(k)}` |")
    if base:
        L.append(f"| hub id | `{base}` |")
    L += ["", "Loading this head for another target (different vocabulary, hidden size or weights "
          "fingerprint) is refused by the loaders."]
    if notice:
        L += ["", f"This draft was trained on the target's hidden states and outputs, so the target's terms apply to "
              f"it: {notice}."]
    elif license_id == "other":
        L += ["", "The license is `other`: a draft trained on a target's states falls under that target's terms; "
              "publish again with `license=<id>` once you know them."]
    L += ["", "## Draft", "",
          f"- family: `{family}`, trainable parameters: {n_params:,}"
          + (f", weights stored in {weights_dtype} (trained in fp32; cast for publishing)" if weights_dtype else ""),
          f"- head config: `{json.dumps(head_cfg.get('head_config', {}), sort_keys=True)}`",
          f"- trained steps: {head_cfg.get('step')}", "", "## Training data", "",
          f"- dataset: `{data.get('name')}` (prepared-cache key `{data.get('key')}`)",
          f"- rows: `{json.dumps(data.get('rows'))}`"]
    if run_cfg:
        d, t, o = run_cfg.get("data", {}), run_cfg.get("train", {}), run_cfg.get("optim", {})
        L += [f"- source: `{d.get('source')}`, max conversations: {d.get('max_conversations')}, "
              f"max length: {d.get('max_length')}, held-out fraction: {d.get('heldout_fraction')} "
              f"(split by {d.get('split_by', 'id')}, deduplicated: {d.get('dedupe', False)})", "",
              "## Training config", "",
              f"- steps {t.get('max_steps')}, micro-batch {t.get('batch_size')} × accumulation {t.get('grad_accum')}, "
              f"precision {t.get('mixed_precision')}, seed {t.get('seed')}",
              f"- optimizer AdamW lr {o.get('lr')}, betas {o.get('betas')}, weight decay {o.get('weight_decay')}, "
              f"{o.get('schedule')} schedule, warmup {o.get('warmup_steps')}, clip {o.get('max_grad_norm')}",
              "- full resolved config: `training_config.yaml`"]
    if summary:
        launch = summary.get("launch") or {}
        resumed = summary.get("resumed_from_step") or 0
        span = f"steps {resumed}–{summary.get('steps')} (resumed; earlier steps' time not included)" if resumed else "trained"
        L += [f"- {span} in {summary.get('seconds')} s at {summary.get('train_tokens_per_s')} tokens/s "
              f"({launch.get('mode', '?')}, {launch.get('num_processes', '?')} process(es))"]
    L += ["", "## Measured τ", ""]
    if taus:
        L += ["τ = mean tokens per target forward (accepted draft tokens + 1); plain decoding is 1.00.", "",
              "| questions | n | drafter | tree | mode | dtype | τ | tokens/s | accept@depth |",
              "|---|---|---|---|---|---|---|---|---|"]
        for r in taus:
            acc = " ".join(f"{a:.2f}" for a in (r.get("accept_at_depth") or []))
            L.append(f"| {r['questions']} | {r['num_questions']} | {r['drafter']} | {r['tree']} | {r['mode']} | "
                     f"{r['dtype']} | {r['tau']:.3f} | {r['tokens_per_s']} | {acc} |")
        speed = [r for r in taus if r.get("speedup_vs_plain")]
        if speed:
            L += ["", "Speed against plain decoding with the same target, dtype and machine (same run): "
                  + "; ".join(f"{r['questions']} {r['dtype']}: {r['speedup_vs_plain']:.2f}× plain" for r in speed) + "."]
        cats = sorted({c for r in taus for c in (r.get("per_category") or {})})
        if cats:
            L += ["", "τ per question category:", "", "| questions | " + " | ".join(cats) + " |",
                  "|---|" + "---:|" * len(cats)]
            for r in taus:
                pc = r.get("per_category") or {}
                L.append(f"| {r['questions']} ({r['dtype']}) | "
                         + " | ".join(f"{pc[c]:.3f}" if pc.get(c) is not None else "–" for c in cats) + " |")
        L += ["", "Per-category τ and the full settings are in `tau_table.json`."]
    else:
        L += ["No τ measured yet (run `eval/acceptance.py checkpoint=<this folder>` and publish again)."]
    if made_by or commit:
        L += ["", "## How it was made", ""]
        if commit:
            L += [f"draftheads commit `{commit}`.", ""]
        if made_by:
            L += ["```bash", made_by.strip(), "```"]
    L += ["", "## Use", "", "```bash", "git clone <draftheads> && cd draftheads && pip install -e .",
          "huggingface-cli download <this repo> --local-dir heads/",
          "python eval/acceptance.py checkpoint=heads/ "
          + (f"target={tgt['name']}" if tgt.get("name") in EMBEDDED_TARGETS
             else f"target=hf target.name={base}" if base else ""),
          "```", "", "In Python: `" + registry.get(family).head.replace(":", ".")
          + ".from_pretrained(folder, target)` with the target from `draftheads.heads.target.load_target`.", ""]
    return "\n".join(L)


def validate(folder: Path, checkpoint: Path, target_cfg: dict[str, Any] | None,
             dtype: str | None = None) -> dict[str, Any]:
    """Everything the Hub copy must satisfy; raises ValueError naming the first problem."""
    import yaml

    missing = [f for f in REQUIRED_FILES if not (folder / f).is_file()]
    if missing:
        raise ValueError(f"publish folder {folder} lacks {missing}")
    cfg, tensors = read_head(folder)  # format, family, readable safetensors
    if dtype:  # the published weights are the checkpoint's, cast
        _, ref = read_head(checkpoint)
        want = cast_floats(ref, dtype)
        if set(want) != set(tensors) or any(not torch.equal(want[k], tensors[k]) for k in want):
            raise ValueError(f"model.safetensors in the publish folder is not the checkpoint's cast to {dtype}")
    elif file_sha256(folder / "model.safetensors") != file_sha256(checkpoint / "model.safetensors"):
        raise ValueError("model.safetensors in the publish folder differs from the checkpoint's")
    card = (folder / "README.md").read_text()
    if not card.startswith("---\n") or card.count("---\n") < 2:
        raise ValueError("README.md has no YAML metadata block")
    meta = yaml.safe_load(card.split("---\n")[1])
    for key in ("library_name", "license", "tags"):
        if key not in meta:
            raise ValueError(f"model card metadata lacks {key!r}")
    json.loads((folder / "tau_table.json").read_text())
    out = {"family": cfg["family"], "tensors": len(tensors), "card_metadata": meta, "loaded": False}
    if target_cfg is not None:
        from draftheads.heads.target import load_target

        target = load_target(target_cfg)
        registry.get(cfg["family"]).load("head").from_pretrained(folder, target)
        out["loaded"] = True
    return out


def upload(folder: Path, repo_id: str, private: bool, branch: str | None, message: str) -> str:
    """create_repo + upload_folder; returns the commit URL. The token is huggingface_hub's business."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import validate_repo_id

    validate_repo_id(repo_id)
    api = HfApi()
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    if branch:
        api.create_branch(repo_id=repo_id, branch=branch, exist_ok=True)
    info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                             commit_message=message, revision=branch, ignore_patterns=[outputs.MANIFEST])
    return str(getattr(info, "commit_url", info))


def main(cfg: DictConfig) -> dict[str, Any]:
    ckpt = Path(cfg.checkpoint)
    head_cfg, tensors = read_head(ckpt)
    run_dir = Path(cfg.run_dir) if cfg.run_dir else ckpt.parent
    if run_dir.name == "checkpoints":  # checkpoint=runs/x/checkpoints/step-N
        run_dir = run_dir.parent
    out = Path(cfg.out) if cfg.out else run_dir / "hub"
    outputs.refuse_inside(out, {"training run": run_dir if cfg.run_dir or (run_dir / "config.yaml").is_file()
                                else None, "head checkpoint": ckpt})
    outputs.check_replaceable(out, "publish", overwrite=bool(cfg.overwrite))
    outputs.claim(out, "publish")
    if cfg.push and not cfg.repo_id:
        raise ValueError("push=true needs repo_id=<owner>/<name>")
    if cfg.repo_id:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(str(cfg.repo_id))
        except HFValidationError as e:
            raise ValueError(f"repo_id={cfg.repo_id!r} is not a valid Hub repository id: {e}") from None
    run_cfg = None
    if (run_dir / "config.yaml").is_file():
        run_cfg = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=False)
    summary = read_json(run_dir / "summary.json")
    own = (run_dir / "eval.json",) if (run_dir / "eval.json").is_file() else ()
    taus = tau_rows(list(own) + [Path(p) for p in cfg.eval], ckpt, optional=own)
    n_params = sum(t.numel() for t in tensors.values())
    # ---- write the folder (atomically: a failed publish never leaves a half-written folder)
    with atomic_dir(out, owner="publish") as tmp:  # replaces only an earlier publish folder, never other files
        if cfg.dtype:
            save_safetensors(cast_floats(tensors, str(cfg.dtype)), tmp / "model.safetensors",
                             metadata=_metadata(ckpt / "model.safetensors"))
        else:
            shutil.copy2(ckpt / "model.safetensors", tmp / "model.safetensors")
        shutil.copy2(ckpt / "config.json", tmp / "config.json")
        (tmp / "README.md").write_text(model_card(head_cfg, run_cfg, summary, taus, str(cfg.license), n_params,
                                                  cfg.dtype, cfg.made_by, cfg.commit or git_commit()))
        import yaml

        (tmp / "training_config.yaml").write_text(
            yaml.safe_dump(run_cfg, sort_keys=False) if run_cfg else "# the run's config.yaml was not found\n")
        (tmp / "tau_table.json").write_text(json.dumps(taus, indent=2))
        if summary:
            keep = {k: v for k, v in summary.items() if k not in ("out_dir", "final")}
            (tmp / "training_summary.json").write_text(json.dumps(keep, indent=2))
    # ---- validate
    target_cfg = None
    if cfg.verify_load:
        if cfg.target.name:
            target_cfg = OmegaConf.to_container(cfg.target, resolve=True)
        elif run_cfg and "target" in run_cfg:
            target_cfg = run_cfg["target"]
        else:
            raise ValueError("verify_load=true needs the run's config.yaml or target.name=<target>; "
                             "or set verify_load=false")
    checks = validate(out, ckpt, target_cfg, cfg.dtype)
    files = sorted(p.name for p in out.iterdir() if p.name != outputs.MANIFEST)
    result = {"folder": str(out), "files": files, "checks": checks, "tau_rows": len(taus),
              "repo_id": cfg.repo_id, "pushed": False}
    print(f"publish folder {out}: {', '.join(files)}; family {checks['family']}, "
          f"{'loaded back with its target' if checks['loaded'] else 'structure validated'}, {len(taus)} τ rows")
    if cfg.push and not cfg.dry_run:
        result["commit"] = upload(out, str(cfg.repo_id), bool(cfg.private), cfg.branch, str(cfg.commit_message))
        result["pushed"] = True
        print(f"uploaded to https://huggingface.co/{cfg.repo_id}")
    elif cfg.push:
        print(f"dry run: would create {'private ' if cfg.private else ''}repo {cfg.repo_id} and upload "
              f"{len(files)} files (set dry_run=false to upload)")
    return result


@job.main(config_name="publish")
def _hydra_main(cfg: DictConfig) -> None:
    main(cfg)


if __name__ == "__main__":
    _hydra_main()
