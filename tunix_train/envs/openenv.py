"""training.rollout.environment=openenv: an OpenEnv environment server (openenv-core, the `envs`
extra) as the environment of multi-turn rollouts, through openenv's own client (GenericEnvClient:
plain dictionaries, no environment package needed on this side).

Each trajectory has a session of its own on the server: reset() opens it and starts the
conversation with the record's prompt, then the reset observation; each of the model's turns
without a tool call is sent as the action {action_field: its text}, and the observation comes back
as a user message with the step's reward and done. The session closes when the trajectory is done.

A server that is dead, slow or answering garbage costs a bounded error: a reset that fails leaves
the record's prompt and says so (the trajectory's steps then fail fast), and a step that fails or
takes longer than training.rollout.tool_timeout_s is an error observation (envs/rollout.py), the
run going on. A server started here (openenv.app) runs for the run and stops with it.
"""

from __future__ import annotations

import atexit
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Optional

from tunix_train.config import ConfigError, OpenEnvConfig
from tunix_train.envs.environment import Environment

MAX_OBSERVATION_CHARS = 4096  # an observation longer than this is cut (and says so)


class OpenEnv(Environment):
    url: str = ""  # set by bound_class
    settings: OpenEnvConfig = OpenEnvConfig()
    timeout_s: float = 10.0
    server: Optional[subprocess.Popen] = None  # the server bound_class started for the run

    @classmethod
    def stop_server(cls) -> None:
        """Stops the server started for the run (the run's end calls it), if one was."""
        if cls.server is not None:
            _stop(cls.server)

    def __init__(self):
        self.client, self.error = None, None

    def reset(self, record: dict[str, Any]) -> list[dict]:
        messages = super().reset(record)
        try:
            from openenv.core.generic_client import GenericEnvClient

            self.client = GenericEnvClient(
                base_url=self.url, connect_timeout_s=self.timeout_s, message_timeout_s=self.timeout_s
            ).sync()
            observation = self._text(self.client.reset().observation)
        except Exception as err:  # noqa: BLE001 - a dead or bad server: the trajectory says so and goes on
            self.error = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
            self.close()
            observation = f"error: the environment could not be reset ({self.error})"
        if observation:
            messages[-1] = {**messages[-1], "content": f"{messages[-1]['content']}\n\n{observation}"}
        return messages

    def step(self, messages: list[dict]) -> tuple[list[dict], float | None, bool]:
        if self.client is None:
            raise ConnectionError(f"the environment's session is gone ({self.error})")
        try:
            result = self.client.step({self.settings.action_field: messages[-1]["content"]})
        except Exception as err:
            self.error = f"{type(err).__name__}: {err}"
            self.close()
            raise
        reward = None if result.reward is None else float(result.reward)
        if result.done:
            self.close()
        text = self._text(result.observation)
        return ([{"role": "user", "content": text}] if text else []), reward, bool(result.done)

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a dead connection
                pass

    def _text(self, observation: Any) -> str:
        field = self.settings.observation_field
        value = observation.get(field, "") if field and isinstance(observation, dict) else observation
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if len(text) > MAX_OBSERVATION_CHARS:
            text = text[:MAX_OBSERVATION_CHARS] + f" [cut: {len(text)} characters]"
        return text


def bound_class(settings: OpenEnvConfig, timeout_s: float) -> type:
    """OpenEnv bound to settings' server (started now when settings.app names one)."""
    try:
        import openenv.core.generic_client  # noqa: F401
    except ImportError:
        raise ConfigError(
            "training.rollout.environment=openenv needs openenv-core: pip install -e '.[envs]'"
        ) from None
    url, server = (settings.url, None) if settings.url else start_server(settings)
    return type(
        "OpenEnv", (OpenEnv,), {"url": url, "settings": settings, "timeout_s": timeout_s, "server": server}
    )


def start_server(settings: OpenEnvConfig) -> tuple[str, subprocess.Popen]:
    """settings.app served by uvicorn on a free local port until this process exits: its URL and
    its process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "uvicorn", settings.app, "--port", str(port), "--log-level", "warning"]
    if settings.app_dir:
        command += ["--app-dir", settings.app_dir]
    # its log goes to a file: a pipe nobody reads fills, and the server then blocks writing to it
    log = tempfile.NamedTemporaryFile("w+", prefix="openenv_server_", suffix=".log", delete=False)
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    atexit.register(_stop, server)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + settings.start_timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            why = " ".join(open(log.name).read().split())[-300:]
            raise ConfigError(
                f"training.rollout.openenv.app={settings.app!r} exited at start ({log.name}): {why}"
            )
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1)
            return url, server
        except OSError:
            time.sleep(0.2)
    _stop(server)
    raise ConfigError(
        f"training.rollout.openenv.app={settings.app!r} did not answer /health within "
        f"{settings.start_timeout_s:g} s (training.rollout.openenv.start_timeout_s)"
    )


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
