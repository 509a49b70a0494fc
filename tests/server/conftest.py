import threading
import time

import httpx
import openai
import pytest
import uvicorn

from server.app import build_app
from server.engine_client import AsyncEngine
from server.metrics import EngineMetrics

MODEL = "tiny-qwen2"
API_KEY = "test-key-123"


class LiveServer:
    """uvicorn on a free loopback port, in a thread (https with a certificate and key: `tls`)."""

    def __init__(self, app, tls: tuple[str, str] | None = None):
        files = {"ssl_certfile": tls[0], "ssl_keyfile": tls[1]} if tls else {}
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", **files))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="session")
def async_engine(engines):
    engine = engines("qwen2", max_num_seqs=16, max_num_batched_tokens=64)
    client = AsyncEngine(engine, EngineMetrics(MODEL))
    yield client
    client.shutdown()


@pytest.fixture(scope="session")
def live(async_engine):
    server = LiveServer(build_app(async_engine, MODEL))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def live_with_key(async_engine):
    server = LiveServer(build_app(async_engine, MODEL, api_key=API_KEY))
    yield server
    server.stop()


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def http(live):
    with httpx.Client(base_url=live.url, timeout=60) as c:
        yield c


def wait_until_idle(engine, timeout=30):
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests() or engine.block_manager.num_free_blocks != engine.block_manager.num_blocks:
        assert time.monotonic() < deadline, "engine did not free its blocks"
        time.sleep(0.02)
