"""The real agent CLIs, Claude Code and Codex CLI (pinned in agent_clis.py, installed from npm into a cache
directory), run headless on their defaults against a ``dgserve serve`` process on the default model: each answers,
every request it sends is accepted (no 4xx, no 5xx in the server's log), a second turn reuses the first's KV from
the prefix cache, and a conversation pushed past the server's window makes the CLI compact it instead of ending.

Marked ``agents`` and deselected by default (pyproject.toml addopts): it takes many minutes on a CPU (each turn
prefills a 14K-19K-token prompt). Run it with

    .venv/bin/python -m pytest -q -m agents tests/agents -s

(``-s`` prints each turn's wall time, requests and prompt tokens). What each CLI sends, and the settings here:
docs/messages-api.md ("Claude Code") and docs/responses-api.md ("Clients").

The small model seldom writes EOS, so a turn may end at its output limit: Claude Code then asks it to go on, up to
three times, and fails the run when the fourth ends so too; Codex fails the turn at once. Such a run is the model's
text, not the protocol: it is run again (ATTEMPTS times in all, Codex CODEX_ATTEMPTS), each time from the CLI's
saved state as it was before the first attempt (a failed turn is kept in the session a later turn resumes, so its
cut-off text would otherwise be in every retry's prompt, and the small model goes on repeating it: seen in CI, a
second Codex turn cut 8 times in a row, its prompt 1,030 tokens longer each time), and every request of every
attempt must still have been accepted."""

from __future__ import annotations

import json
import pathlib
import shutil
import tempfile

import pytest
from agent_clis import CLAUDE_CODE, CODEX, SERVED_NAME, Server, Turn, cli_env, installed_cli, long_window_model

pytestmark = pytest.mark.agents

ATTEMPTS = 4
TURN_TIMEOUT = 600  # a safety bound only: turns took 6-161 s here on a busy machine (a 19K-token CPU prefill)
CLAUDE_OUTPUT_CAP = "256"  # CLAUDE_CODE_MAX_OUTPUT_TOKENS: Claude Code asks for more itself when a reply ends there
# the server's --default-max-tokens (Codex sends no limit, and fails a turn cut by one) and Codex's tries a turn: the
# small model writes EOS within its first block or repeats itself to the cap. Measured on Codex's own first request
# (its 14K-token prompt, 24 samples): 14 ended, all within 63 tokens; 10 ran to 1,024. So a one-block cap loses no
# turn that would end and cuts a failed try's cost by four (12-28 s here); 16 tries, as the rate moves with the
# prompt (its environment context names the directory and the date): one first turn was cut 7 times in a row
CODEX_OUTPUT_CAP, CODEX_ATTEMPTS = "256", 4 * ATTEMPTS
QUIET = {"DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return long_window_model(tmp_path_factory.mktemp("agent-model"))


@pytest.fixture(scope="module")
def server(model):
    s = Server(model, "--default-max-tokens", CODEX_OUTPUT_CAP)
    yield s
    s.stop()


def claude_turn(exe: str, server: Server, home: pathlib.Path, prompt: str, *flags: str, window: bool = True):
    """``claude -p`` with its defaults: base URL, model, a dummy key, the output cap and (``window``) the window;
    with ``window=False`` it assumes a window of 1M tokens and learns of the server's only from a refusal."""
    settings = {"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "dummy", **QUIET}
    settings["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = CLAUDE_OUTPUT_CAP
    if window:
        settings["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(server.max_model_len)
    argv = [exe, "-p", prompt, *flags, "--output-format", "json", "--model", SERVED_NAME]
    env = cli_env(home, **settings)
    return run_turn(argv, env, home, home / ".claude", server, claude_model_limited, refusals=not window)


def claude_result(turn: Turn) -> dict:
    return json.loads(turn.stdout.strip().splitlines()[-1])


def claude_model_limited(turn: Turn) -> bool:
    return turn.rc != 0 and claude_result(turn).get("api_error") == "max_output_tokens"


def codex_turn(exe, server: Server, home: pathlib.Path, prompt: str, *resume: str, window=True):
    """``codex exec`` with its defaults and a CODEX_HOME whose config.toml names our Responses API and (``window``)
    the server's window as ``model_context_window``."""
    codex_home = home / "codex-home"
    codex_home.mkdir(exist_ok=True)
    config = f'model = "{SERVED_NAME}"\nmodel_provider = "dgserve"\n'
    if window:
        config += f"model_context_window = {server.max_model_len}\n"
    config += f'\n[model_providers.dgserve]\nname = "dgserve"\nbase_url = "{server.url}/v1"\nwire_api = "responses"\n'
    (codex_home / "config.toml").write_text(config + 'env_key = "DGSERVE_API_KEY"\n')
    env = cli_env(home, CODEX_HOME=str(codex_home), DGSERVE_API_KEY="dummy")
    argv = [exe, "exec", "--skip-git-repo-check", "--json", *resume, prompt]
    return run_turn(
        argv, env, home, codex_home, server, codex_model_limited, refusals=not window, attempts=CODEX_ATTEMPTS
    )


def codex_events(turn: Turn) -> list[dict]:
    return [json.loads(line) for line in turn.stdout.splitlines() if line.startswith("{")]


def codex_model_limited(turn: Turn) -> bool:
    failed = [e for e in codex_events(turn) if e.get("type") == "turn.failed"]
    return turn.rc != 0 and bool(failed) and "max_output_tokens" in failed[-1]["error"]["message"]


def run_turn(argv, env, cwd, state: pathlib.Path, server: Server, model_limited, refusals=False, attempts=ATTEMPTS):
    """The turn, run again (``attempts`` in all) while it fails only because the model's text hit its output limit,
    each time from ``state`` (the CLI's directory of settings and sessions) as it was before the first; every
    attempt's requests must have been accepted (``refusals``: or refused with a 400, the overflow)."""
    seen: list[tuple[str, str, int]] = []
    with tempfile.TemporaryDirectory() as saved:
        before = pathlib.Path(saved) / "state"
        if state.exists():
            shutil.copytree(state, before, symlinks=True)
        for attempt in range(1, attempts + 1):
            if attempt > 1:  # the failed attempt's session goes: the retry starts where the first attempt did
                shutil.rmtree(state, ignore_errors=True)
                if before.exists():
                    shutil.copytree(before, state, symlinks=True)
            turn = Turn(argv, env, cwd, server, TURN_TIMEOUT)
            turn.all_requests = seen = [*seen, *turn.requests]
            print(f"\n{pathlib.Path(argv[0]).name} {' '.join(argv[1:3])[:40]}: attempt {attempt}: {turn.describe()}")
            failed = [r for r in turn.failed_requests() if not (refusals and r[2] == 400)]
            assert not failed, (failed, turn.stdout[-2000:], turn.stderr[-2000:])
            if not model_limited(turn):
                return turn
    return turn


def test_claude_code_answers_on_its_defaults_and_its_second_turn_hits_the_prefix_cache(server, tmp_path):
    exe = installed_cli(CLAUDE_CODE)
    first = claude_turn(exe, server, tmp_path, "say hi")
    assert first.rc == 0, (first.stdout[-2000:], first.stderr[-2000:])
    result = claude_result(first)
    assert result["is_error"] is False and result["result"].strip()
    assert next(r[:2] for r in first.requests if r[0] == "POST") == ("POST", "/v1/messages")
    usage = next(e["message"]["usage"] for e in claude_transcript(tmp_path) if e.get("type") == "assistant")
    print(f"Claude Code's first prompt: {usage['input_tokens'] + usage['cache_read_input_tokens']} tokens")
    second = claude_turn(exe, server, tmp_path, "say hi again", "--continue")
    assert second.rc == 0, (second.stdout[-2000:], second.stderr[-2000:])
    result = claude_result(second)
    assert result["is_error"] is False and result["result"].strip()
    assert result["usage"]["cache_read_input_tokens"] > 0  # the Messages usage, from the prefix cache
    assert second.delta["dgserve_prefix_cache_hits_total"] > 0


def test_codex_answers_on_its_defaults_and_its_second_turn_hits_the_prefix_cache(server, tmp_path):
    exe = installed_cli(CODEX)
    first = codex_turn(exe, server, tmp_path, "say hi")
    assert first.rc == 0, (first.stdout[-2000:], first.stderr[-2000:])
    answers = [e["item"]["text"] for e in codex_events(first) if e.get("item", {}).get("type") == "agent_message"]
    assert answers and answers[-1].strip()
    assert ("POST", "/v1/responses") in [r[:2] for r in first.requests]
    second = codex_turn(exe, server, tmp_path, "say hi again", "resume", "--last")
    assert second.rc == 0, (second.stdout[-2000:], second.stderr[-2000:])
    done = [e for e in codex_events(second) if e.get("type") == "turn.completed"]
    assert done and done[-1]["usage"]["cached_input_tokens"] > 0  # the Responses usage's cached_tokens
    assert second.delta["dgserve_prefix_cache_hits_total"] > 0


def words(tokens: int) -> str:
    """About ``tokens`` tokens of plain English with the shipped tokenizer (21 tokens a sentence)."""
    return "Please read these notes about the package manager and the version control system carefully. " * (
        tokens // 21
    )


def latest(paths) -> pathlib.Path:
    """The file written last: the session --continue or ``resume --last`` goes on with."""
    return max(paths, key=lambda p: p.stat().st_mtime_ns)


def claude_transcript(home: pathlib.Path) -> list[dict]:
    session = latest((home / ".claude" / "projects").glob("*/*.jsonl"))
    return [json.loads(line) for line in session.read_text().splitlines() if line.strip()]


def test_claude_code_compacts_a_conversation_the_server_refuses_as_too_long(model, tmp_path):
    """Claude Code's base prompt (about 19K tokens) plus an 8.4K-token message fits a 30,000-token window; a
    second message of 4.7K tokens does not: the server refuses it (400, "prompt is too long: N tokens > M
    maximum"), Claude Code compacts the conversation (its summary request) and answers from the summary. The
    window is not given to it (``CLAUDE_CODE_MAX_CONTEXT_TOKENS`` unset), so it compacts on the refusal only."""
    exe = installed_cli(CLAUDE_CODE)
    server = Server(model, "--max-model-len", "30000")
    try:
        first = claude_turn(exe, server, tmp_path, words(8400) + "Now say hi.", window=False)
        assert first.rc == 0, (first.stdout[-2000:], first.stderr[-2000:])
        second = claude_turn(exe, server, tmp_path, words(4700) + "Say hi.", "--continue", window=False)
    finally:
        server.stop()
    refused = [r for r in first.requests + second.requests if r[2] == 400]
    assert refused and all(r[1] == "/v1/messages" for r in refused)
    assert second.rc == 0, (second.stdout[-2000:], second.stderr[-2000:])
    result = claude_result(second)
    assert result["is_error"] is False and result["result"].strip()
    events = claude_transcript(tmp_path)
    compactions = [e for e in events if e.get("subtype") == "compact_boundary"]
    assert compactions and compactions[-1]["compactMetadata"]["preTokens"] > server.max_model_len
    assert any(e.get("isCompactSummary") for e in events)  # the conversation goes on from the summary
    answered = [e["message"]["usage"] for e in events if e.get("type") == "assistant" and "usage" in e["message"]]
    last = answered[-1]
    assert last["input_tokens"] + last["cache_read_input_tokens"] < server.max_model_len


def codex_rollout(home: pathlib.Path) -> list[dict]:
    rollout = latest((home / "codex-home" / "sessions").glob("*/*/*/rollout-*.jsonl"))
    return [json.loads(line) for line in rollout.read_text().splitlines() if line.strip()]


def test_codex_compacts_before_the_window_and_ends_the_turn_on_a_refusal(model, tmp_path):
    """Codex compacts by its own count against ``model_context_window``: a first turn of a 7,800-token message (a
    22K-token prompt, over its auto-compact limit of a 24,000-token window) makes it compact before the second
    turn (its summary request, accepted; the rollout's ``compacted`` item), and the second turn is then answered.
    A refusal does not make it compact: without ``model_context_window``, a message that takes the conversation
    past the window is refused (400, ``context_length_exceeded``) and Codex ends the turn, exit status 1, with
    "Codex ran out of room in the model's context window"."""
    exe = installed_cli(CODEX)
    server = Server(model, "--max-model-len", "24000", "--default-max-tokens", CODEX_OUTPUT_CAP)
    try:
        # a first turn cut at the output limit leaves Codex without the usage it counts by (a failed turn reports
        # none), so it would not compact: the turn is run again (from no session) until it ends
        first = codex_turn(exe, server, tmp_path, words(7800) + "Now say hi.")
        assert first.rc == 0, (first.stdout[-2000:], first.stderr[-2000:])
        second = codex_turn(exe, server, tmp_path, "Say hi.", "resume", "--last")
        assert second.rc == 0, (second.stdout[-2000:], second.stderr[-2000:])
        assert [e for e in codex_rollout(tmp_path) if e.get("type") == "compacted"]  # its summary, then the turn
        assert len([r for r in second.all_requests if r[0] == "POST"]) >= 2  # the summary's, the turn's
        third = codex_turn(exe, server, tmp_path, words(3000) + "Say hi.", "resume", "--last", window=False)
    finally:
        server.stop()
    assert third.rc == 1 and [r[2] for r in third.requests if r[0] == "POST"] == [400]
    failed = [e for e in codex_events(third) if e.get("type") == "turn.failed"]
    assert failed and "ran out of room in the model's context window" in failed[-1]["error"]["message"]
    assert len([e for e in codex_rollout(tmp_path) if e.get("type") == "compacted"]) == 1  # no compaction after
