"""dgserve.client (sync and asyncio) and the ``dgserve`` CLI against the shared server."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from dgserve.__main__ import main
from dgserve.client import AsyncClient, Client
from dgserve.sampling_params import KNOBS

NUMERIC_KNOBS = sum(k.numeric for k in KNOBS.values())  # GetModelInfo reports the bounds of each


def test_sync_client(server, local_engine):
    from dgserve import SamplingParams

    with Client(server.target) as c:
        res = c.generate_text("client text", max_new_tokens=30, max_denoising_steps=3, seed=8, stop=None)
        ref = local_engine.generate("client text", SamplingParams(max_new_tokens=30, max_denoising_steps=3, seed=8))
        assert (res.token_ids, res.text, res.finish_reason, res.seed) == (ref.token_ids, ref.text, ref.finish_reason, 8)
        assert res.usage.completion_tokens == len(res.token_ids)
        assert c.tokenize("client text") == local_engine.prompt_ids("client text")
        assert c.model_info().model == "tiny" and c.health() == "SERVING" and c.health("") == "SERVING"
        chat = c.generate_text(messages=[{"role": "user", "content": "hi"}], max_new_tokens=4, max_denoising_steps=2)
        assert chat.finish_reason in ("eos", "length")
        with pytest.raises(grpc.RpcError) as e:
            c.abort("unknown-id")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_async_client(server):
    async def go():
        async with AsyncClient(server.target) as c:
            kinds = [
                e.WhichOneof("event")
                async for e in c.generate(token_ids=[2, 7, 8], max_new_tokens=20, max_denoising_steps=2, seed=1)
            ]
            res = await c.generate_text("x", max_new_tokens=5, max_denoising_steps=2, seed=1, request_id="async-1")
            return kinds, res, await c.abort("async-1"), await c.tokenize("x"), (await c.model_info()).vocab_size

    kinds, res, outcome, ids, vocab = asyncio.run(go())
    assert kinds[0] == "started" and kinds[-1] == "finished" and kinds.count("block") >= 1
    assert res.request_id == "async-1" and len(res.token_ids) <= 5
    assert outcome == "already_finished" and ids[0] == 2 and vocab == 300


def test_cli_generate_streams_blocks_with_progress(server, capsys):
    assert (
        main(
            [
                "generate",
                "hello cli",
                "--server",
                server.target,
                "--max-new-tokens",
                "40",
                "--max-denoising-steps",
                "3",
                "--seed",
                "4",
                "--ignore-eos",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert err.count("[block ") == 3 and "[block 2: 8 tokens, 3 steps" in err
    assert "# finished: length; " in err and "40 generated tokens in 3 blocks" in err


def test_cli_generate_json_and_errors(server, capsys):
    assert (
        main(
            [
                "generate",
                "--prompt",
                "x",
                "--server",
                server.target,
                "--json",
                "--max-new-tokens",
                "3",
                "--max-denoising-steps",
                "2",
                "--seed",
                "1",
            ]
        )
        == 0
    )
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert "started" in events[0] and "finished" in events[-1]
    assert main(["generate", "x", "--server", server.target, "--max-new-tokens", "0"]) == 1
    assert "INVALID_ARGUMENT: params.max_new_tokens" in capsys.readouterr().err


def test_cli_info(server, capsys):
    assert main(["info", "--server", server.target]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model"] == "tiny" and info["canvas_length"] == 16 and len(info["bounds"]) == NUMERIC_KNOBS


def test_cli_local_mode(model_dir, capsys):
    assert (
        main(
            [
                "generate",
                "hi",
                "--model",
                str(model_dir),
                "--max-new-tokens",
                "20",
                "--max-denoising-steps",
                "2",
                "--seed",
                "3",
                "--json",
            ]
        )
        == 0
    )
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["block"] for x in lines] == list(range(len(lines))) and lines[-1]["finish_reason"]
