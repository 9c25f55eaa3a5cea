"""Fixtures: one shared server over a tiny random checkpoint with a BPE tokenizer, stubs, its HTTP URL with an
httpx client and the official openai and anthropic clients on it, a local engine, and a check that the server
logged no error or traceback during a test."""

from __future__ import annotations

import logging

import grpc
import httpx
import pytest
from service_helpers import ServerThread, base_config

from dgserve import Engine
from dgserve.model.default_model import write_tiny_random_model
from dgserve.v1 import text_generation_pb2_grpc as pb_grpc


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    return write_tiny_random_model(tmp_path_factory.mktemp("dgserve-model") / "tiny-chat")


@pytest.fixture(scope="session")
def server(model_dir):
    s = ServerThread(base_config(model_dir))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def url(server) -> str:
    """The shared server's HTTP base URL."""
    return server.http_url


@pytest.fixture(scope="session")
def openai_client(url):
    """The official openai client on the shared server (no retries: a test sees every answer)."""
    import openai

    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def anthropic_client(url):
    """The official anthropic client on the shared server (no retries)."""
    import anthropic

    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def http(url):
    """An httpx client on the shared server's HTTP door (paths relative to its base URL)."""
    with httpx.Client(base_url=url, timeout=60) as c:
        yield c


@pytest.fixture
def no_traceback(caplog):
    """Fails the test when the server logged an error or a traceback while it ran."""
    caplog.set_level(logging.INFO)
    yield
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage()[:200] for r in bad]


@pytest.fixture(scope="session")
def channel(server):
    ch = grpc.insecure_channel(server.target)
    yield ch
    ch.close()


@pytest.fixture(scope="session")
def stub(channel):
    return pb_grpc.TextGenerationStub(channel)


@pytest.fixture(scope="session")
def local_engine(model_dir) -> Engine:
    """A second engine over the same checkpoint, for comparing with what the server streams."""
    return Engine.from_pretrained(model_dir)
