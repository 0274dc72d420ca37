"""How every entry point ends: a user error is one line on stderr and exit code 2; a bug keeps its traceback.

Why: Hydra prints a 15-25-line traceback ("Error executing job ...") before even a clear ``ValueError``
message, so a user hunting for what to fix reads past the stack first. Entries declare themselves with
:func:`main` (instead of ``hydra.main``) or run through :func:`cli` (plain ``argparse``/``sys.argv``
scripts); both share :func:`guarded`. :func:`config_int` reads a numeric setting without ``x or default``.

- User errors (:data:`USER_ERRORS`: ``ValueError`` and its subclasses such as ``DataError``, missing or
  wrong files, a required ``???`` config value left unset; and disk errors at an output: full, read-only, not
  writable, a file where a folder must be) print ``error: <message>`` on one line and exit 2.
- Hydra's own config-composition errors (unknown key, unknown config group option) keep Hydra's short
  message (it prints no traceback for them) and exit 2 instead of 1.
- Anything else is a bug: its traceback is shown as before (exit 1).
- ``HYDRA_FULL_ERROR=1`` or ``DRAFTHEADS_DEBUG=1`` re-raise user errors too, with their traceback.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from draftheads.heads.malloc import keep_freed_memory
from draftheads.heads.outputs import USER_ERRNOS, os_error_message, release_all

USER_EXIT = 2
DEBUG_ENV = ("HYDRA_FULL_ERROR", "DRAFTHEADS_DEBUG")

F = TypeVar("F", bound=Callable[..., Any])


def _user_errors() -> tuple[type[BaseException], ...]:
    errs: list[type[BaseException]] = [ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError,
                                       PermissionError]
    try:
        from omegaconf.errors import MissingMandatoryValue

        errs.append(MissingMandatoryValue)
    except ImportError:  # pragma: no cover - omegaconf comes with hydra
        pass
    return tuple(errs)


USER_ERRORS = _user_errors()


def is_user_error(exc: BaseException) -> bool:
    """A user error: one of :data:`USER_ERRORS`, or an operating-system error of a path the user chose (a full or
    read-only disk, no permission, a file where a folder must be)."""
    return isinstance(exc, USER_ERRORS) or (isinstance(exc, OSError) and exc.errno in USER_ERRNOS)


def debug_requested() -> bool:
    """Whether the user asked for full tracebacks (HYDRA_FULL_ERROR=1 or DRAFTHEADS_DEBUG=1)."""
    return any(os.environ.get(k, "").strip().lower() not in ("", "0", "false", "no") for k in DEBUG_ENV)


def one_line(exc: BaseException) -> str:
    """The error's message on a single line (OmegaConf appends 'full_key: ...' lines; keep what names the key)."""
    if type(exc).__name__ == "MissingMandatoryValue":
        key = getattr(exc, "full_key", None) or str(exc).splitlines()[0].rsplit(":", 1)[-1].strip()
        return f"config key {key} has no value (it is ??? in the config): pass {key}=<value>"
    if isinstance(exc, OSError) and exc.errno in USER_ERRNOS:
        return os_error_message(exc)
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = "; ".join(lines) or type(exc).__name__
    if isinstance(exc, OSError) and not isinstance(exc, PermissionError) and exc.filename and str(exc.filename) not in text:
        text += f": {exc.filename}"
    return text


def report(exc: BaseException) -> None:
    """Print the one-line message of a user error on stderr."""
    sys.stdout.flush()
    print(f"error: {one_line(exc)}", file=sys.stderr, flush=True)


def guarded(fn: F) -> F:
    """``fn`` with user errors turned into one stderr line and ``SystemExit(2)`` (unless debugging is asked)."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (*USER_ERRORS, OSError) as e:
            if debug_requested() or not is_user_error(e):
                raise
            report(e)
            raise SystemExit(USER_EXIT) from None
        finally:
            release_all()  # the job's output locks (heads/outputs.py): a sweep's next job may write there
    return run  # type: ignore[return-value]


def launch_rank(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(rank, world size) that a torchrun or accelerate launch sets in ``RANK``/``WORLD_SIZE``; (0, 1) outside one."""
    env = os.environ if env is None else env
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))


def rank_suffix() -> str:
    """``.rank<RANK>`` inside a multi-process launch (torchrun, accelerate), else ``""``: configs name per-process
    files with it (``${rank_suffix:}``), so processes sharing a Hydra folder do not interleave one log."""
    rank, world = launch_rank()
    return f".rank{rank}" if world != 1 else ""


def register_resolvers() -> None:
    """The OmegaConf resolvers shipped configs use (idempotent)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("rank_suffix"):
        OmegaConf.register_new_resolver("rank_suffix", rank_suffix)


def main(config_name: str, config_path: str = "../conf") -> Callable[[F], F]:
    """Drop-in for ``@hydra.main(version_base=None, config_path=..., config_name=...)`` with :func:`guarded`.

    Hydra names the job (its log file ``<name>.log``) after the decorated function's file and resolves a
    relative ``config_path`` against it; the wrapper lives here, so both are fixed from the entry's own file.
    """
    import hydra

    register_resolvers()

    def deco(task: F) -> F:
        entry_file = Path(inspect.getfile(task)).resolve()
        conf = config_path if os.path.isabs(config_path) else str((entry_file.parent / config_path).resolve())
        started = False

        def task_guarded(cfg: Any) -> Any:
            nonlocal started
            started = True
            from draftheads.heads.schema import check

            def checked(cfg: Any) -> Any:
                check(cfg)  # choices and ranges of the shared groups, before anything loads
                check_own_groups(cfg, Path(conf), config_name)
                return task(cfg)
            return guarded(functools.wraps(task)(checked))(cfg)

        functools.update_wrapper(task_guarded, task)
        # Hydra reads the job name from the function's module when it is not __main__ (see
        # hydra._internal.utils.detect_task_name): the entry file's stem, as with a plain hydra.main.
        task_guarded.__module__ = entry_file.stem
        hydra_entry = hydra.main(version_base=None, config_path=conf, config_name=config_name)(task_guarded)

        @functools.wraps(task)
        def entry(*args: Any, **kwargs: Any) -> Any:
            enter_process()
            try:
                return hydra_entry(*args, **kwargs)
            except SystemExit as e:
                # Hydra exits 1 after printing a composition error (unknown key, missing option) without
                # having run the task: that is a user error too.
                if e.code == 1 and not started:
                    raise SystemExit(USER_EXIT) from None
                raise
        return entry  # type: ignore[return-value]
    return deco


def check_own_groups(cfg: Any, conf_dir: Path, config_name: str) -> None:
    """Refuse a family's group option (``head=...``, or an experiment overriding it) composed into another family's
    job: its keys are not the keys of the job's own default option, and the job would fail later on a missing key.
    Groups with a typed schema (heads/schema.py) are checked by Hydra itself."""
    import yaml

    from draftheads.heads.schema import SCHEMAS

    primary = yaml.safe_load((conf_dir / f"{config_name}.yaml").read_text()) or {}
    for entry in primary.get("defaults", []) or []:
        if not isinstance(entry, dict) or len(entry) != 1:
            continue
        (group, option), = entry.items()
        own = conf_dir / str(group) / f"{option}.yaml"
        if group in SCHEMAS or not isinstance(option, str) or not own.is_file() or group not in cfg:
            continue
        allowed = set(yaml.safe_load(own.read_text()) or {}) - {"defaults"}
        extra = sorted(set(cfg[group].keys()) - allowed)
        if extra:
            chosen, exp = _chosen(group), _chosen("experiment")
            source = (f"{group}={chosen}" if chosen not in (None, option) else
                      f"+experiment={exp}" if exp not in (None, "None") else f"a +{group}.* override")
            raise ValueError(f"{source} does not belong to {config_name}: it sets {group} keys {extra} that this job "
                             f"does not have (conf/{group}/{option}.yaml has {sorted(allowed)}); use an option made "
                             f"for {config_name}, or run the job it belongs to")


def _chosen(group: str) -> str | None:
    """The option Hydra composed for ``group`` (None outside a Hydra run)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return str(HydraConfig.get().runtime.choices.get(group)) if HydraConfig.initialized() else None
    except Exception:  # pragma: no cover - Hydra internals
        return None


def enter_process() -> bool:
    """What every process entry does first (``main``, ``cli``, benchmark scripts): CPU tensors reuse freed memory
    (heads/malloc.py), a bad ``DRAFTHEADS_MALLOC`` being a one-line user error. Returns whether it applied."""
    return guarded(keep_freed_memory)()


def cli(fn: Callable[..., Any], *args: Any) -> None:
    """Run a plain script's ``main(*args)`` and exit: its int return value is the exit code (else 0)."""
    enter_process()
    result = guarded(fn)(*args)
    sys.exit(result if isinstance(result, int) and not isinstance(result, bool) else 0)


def config_int(cfg: Any, key: str, default: int | None, minimum: int = 1, where: str = "") -> int | None:
    """``cfg[key]`` as an int >= ``minimum``; a missing key or null means ``default``.

    Why not ``int(cfg.get(key) or default)``: that turns an explicit 0 into the default, so a check on
    the value can never fire and the run silently uses a setting nobody asked for."""
    value = cfg.get(key) if cfg is not None else None
    if value is None:
        return default
    name = f"{where}.{key}" if where else key
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}") from None
    if out != value and not isinstance(value, str):  # 2.5 is not 2
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out
