"""The wandb logger's settings and environment, checked before any rank starts.

Rank 0 calls ``wandb.init`` only after the model is loaded: a project name wandb refuses, a
``WANDB_*`` variable it cannot read, or ``logger.mode=online`` with no credentials ended the
run there, in a traceback from inside wandb. The same rules are checked here, on the node that
prepares the run, and said as a config error naming the setting or variable.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

from memtune.config.schema import ConfigError, LoggerConfig

PROJECT_CHARS = "/\\#?%:"
"""What wandb refuses in a project name (wandb.sdk.wandb_settings.validate_project)."""
PROJECT_MAX = 128


def wandb_mode(
    logger: LoggerConfig | Any, env: Mapping[str, str] | None = None
) -> Literal["online", "offline"]:
    """The mode rank 0 starts wandb in: logger.mode, with ``auto`` online when logged in
    ($WANDB_API_KEY, or a ``~/.netrc`` entry for the server ``wandb login`` logs in to: the
    host of $WANDB_BASE_URL when set, else wandb's default, :data:`WANDB_HOSTS`)."""
    env = os.environ if env is None else env
    if logger.mode in ("online", "offline"):
        return "online" if logger.mode == "online" else "offline"
    netrc = Path(env.get("NETRC") or Path.home() / ".netrc")
    base = env.get("WANDB_BASE_URL")
    hosts = (urlparse(base).hostname or base,) if base else WANDB_HOSTS
    words = (netrc.read_text(errors="ignore") if netrc.is_file() else "").split()
    machines = {host for word, host in itertools.pairwise(words) if word == "machine"}
    logged_in = any(host in machines for host in hosts)
    return "online" if env.get("WANDB_API_KEY") or logged_in else "offline"


WANDB_HOSTS = ("api.wandb.ai", "api.forge.coreweave.com")
"""Where ``wandb login`` writes its ~/.netrc entry without $WANDB_BASE_URL: wandb's default
server (api.forge.coreweave.com since the pinned 0.31; api.wandb.ai before it)."""


def check_logger(logger: LoggerConfig, env: Mapping[str, str] | None = None) -> None:
    """Raise ConfigError for what ``wandb.init`` would refuse in rank 0. wandb is imported
    only when a ``WANDB_*`` variable is set or the run goes online (seconds otherwise spent on
    every start)."""
    if logger.backend != "wandb":
        return
    env = os.environ if env is None else env
    project = logger.project
    found = sorted({c for c in project if c in PROJECT_CHARS})
    if found or len(project) > PROJECT_MAX:
        why = (
            f"has {' '.join(found)}" if found else f"is {len(project)} characters long"
        ) + f"; wandb takes at most {PROJECT_MAX} characters and none of {' '.join(PROJECT_CHARS)}"
        raise ConfigError(f"logger.project={project!r} is not a wandb project name: it {why}")
    if not any(name.startswith("WANDB_") for name in env) and wandb_mode(logger, env) != "online":
        return
    _check_with_wandb(logger, env)


def _check_with_wandb(logger: LoggerConfig, env: Mapping[str, str]) -> None:
    """wandb's own reading of the environment, and with ``online`` its own look for the
    credentials (no request is sent)."""
    import wandb
    from pydantic import ValidationError

    settings = wandb.Settings()
    variables = {k: v for k, v in env.items() if k.startswith("WANDB_")}
    for name, value in sorted(variables.items()):
        try:  # one variable at a time: the error names the one wandb refuses
            settings.update_from_env_vars({name: value})
        except ValidationError as err:
            reason = err.errors()[0]["msg"]
            raise ConfigError(f"${name}={value!r}: wandb refuses it: {reason}") from None
        except (ValueError, wandb.Error) as err:
            raise ConfigError(f"${name}={value!r}: wandb refuses it: {err}") from None
    if wandb_mode(logger, env) != "online":
        return
    try:
        from wandb.sdk.lib.wbauth import authenticate
    except ImportError:  # another wandb: rank 0's wandb.init says it
        return
    previous = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)  # wandb reads its credentials from os.environ
    try:
        found = authenticate.authenticate_session(
            host=settings.base_url,
            source="memtune",
            prompt=False,
            update_session=False,
        )
    except wandb.Error as err:
        raise ConfigError(f"logger.mode={logger.mode}: wandb's credentials: {err}") from None
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if found is None:
        raise ConfigError(
            f"logger.mode={logger.mode}: no wandb credentials for {settings.base_url} "
            "($WANDB_API_KEY, or `wandb login`): log in, or use logger.mode=offline "
            "(`wandb sync RUN_DIR/wandb` later) or logger.mode=auto (online when logged in)"
        )
