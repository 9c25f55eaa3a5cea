"""Fixtures: one shared server over a tiny random checkpoint with a BPE tokenizer, stubs, a local engine."""

from __future__ import annotations

import grpc
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
