"""The playground and the dashboard in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``) driven by selenium against a real ``dgserve serve`` process on the shipped model, with
``--auth-token-file`` (docs/playground.md).

The playground asks for the token, runs a seeded generation with drafts and draws it: the test reads back what it
drew (data attributes of ``#canvas``) and compares it with the same request made with httpx: every draft frame it
drew is that request's canvas at that block and step, the committed tokens are the same, and the text is what the
non-streaming API returns. "Replay" draws the same animation again. Started from a draft with pinned ranges
(clicked and shift-clicked on its token cells), every frame and the output hold the draft's tokens at the pinned
positions while the others move; a draft too long for the canvases shows the server's 400. The dashboard's
numbers move after requests.
No page logs an error (a Content-Security-Policy violation would). Set DGSERVE_PAGE_SHOTS to a folder to keep
screenshots of both pages there (docs/ holds the ones the README shows).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import time

import httpx
import pytest
import storm

from dgserve.model.default_model import default_model_path
from dgserve.text.tokenizer import Tokenizer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
TOKEN = "playground-secret"
REQUEST = {"prompt": "Once upon a time", "max_tokens": 48, "max_denoising_steps": 12, "seed": 11}

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="headless browser test: Debian's chromium and chromium-driver are not installed "
    "(apt-get install -y chromium chromium-driver; .ci/run installs them when it can)",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokens = tmp_path_factory.mktemp("auth") / "tokens"
    tokens.write_text(TOKEN + "\n")
    srv = storm.ServerProcess(default_model_path(), "--auth-token-file", str(tokens))
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e .[test])")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def base(server) -> str:
    return f"http://127.0.0.1:{server.http_port}"


def wait(what, timeout: float = 180.0, every: float = 0.2):
    """``what()`` once it is truthy; AssertionError after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        assert time.monotonic() < end, "timed out"
        time.sleep(every)


def errors(driver) -> list[str]:
    """The page's logged errors (a CSP violation, a script error, a failed load), less the 401s the token
    prompt is about."""
    logged = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    return [m for m in logged if "status of 401" not in m]


def set_field(driver, element_id: str, value) -> None:
    el = driver.find_element("id", element_id)
    el.clear()
    el.send_keys(str(value))


def stream(server, body: dict) -> tuple[dict, list[int]]:
    """The request streamed with drafts over httpx: ({(block, step): canvas ids}, committed ids)."""
    drafts, committed = {}, []
    headers = {"Authorization": f"Bearer {TOKEN}"}
    payload = {**body, "stream": True, "drafts": True}
    with httpx.stream("POST", base(server) + "/v1/completions", json=payload, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            x = json.loads(line[6:]).get("dgserve", {})
            if "draft" in x:
                drafts[(x["draft"]["block_index"], x["draft"]["step"])] = x["draft"]["token_ids"]
            if "block" in x:
                committed += x["block"]["token_ids"]
    return drafts, committed


def run_and_read(driver) -> dict:
    driver.find_element("id", "run").click()
    canvas = driver.find_element("id", "canvas")
    wait(lambda: canvas.get_attribute("data-state") in ("done", "error"))
    assert canvas.get_attribute("data-state") == "done", driver.find_element("id", "status").text
    return {
        "frames": int(canvas.get_attribute("data-frames")),
        "log": json.loads(canvas.get_attribute("data-frame-log")),
        "committed": json.loads(canvas.get_attribute("data-committed")),
        "text": canvas.get_attribute("data-text"),
        "seed": int(canvas.get_attribute("data-seed")),
    }


def check_frames(page: dict, drafts: dict) -> None:
    """Every frame the page drew is the httpx request's canvas at that block and step (a reader that falls behind
    may miss a draft, so each side may lack some steps), and the page drew several steps of every block."""
    shared = 0
    for block, step, *ids in page["log"]:
        if (block, step) in drafts:
            assert ids == drafts[(block, step)], (block, step)
            shared += 1
    assert shared >= len(page["log"]) // 2 and shared > 0
    blocks = {b for b, *_ in page["log"]}
    assert blocks == {b for b, _ in drafts}


def test_playground_draws_the_seeded_canvas_the_api_returns(server, browser):
    browser.get(base(server) + "/playground")
    # auth on: the page asks for the token before anything runs; a wrong one is refused
    auth = browser.find_element("id", "auth")
    wait(lambda: auth.is_displayed(), 30)
    set_field(browser, "token", "wrong")
    browser.find_element("css selector", "#token-form button").click()
    wait(lambda: "not accepted" in browser.find_element("id", "auth-msg").text, 30)
    set_field(browser, "token", TOKEN)
    browser.find_element("css selector", "#token-form button").click()
    wait(lambda: not auth.is_displayed(), 30)
    assert browser.execute_script("return sessionStorage.getItem('dgserve-token')") == TOKEN

    set_field(browser, "prompt", REQUEST["prompt"])
    for k in ("max_tokens", "max_denoising_steps", "seed"):
        set_field(browser, k, REQUEST[k])
    page = run_and_read(browser)

    drafts, committed = stream(server, REQUEST)
    whole = httpx.post(
        base(server) + "/v1/completions", json=REQUEST, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120
    ).json()
    assert page["seed"] == REQUEST["seed"] and page["frames"] == len(page["log"]) > 0
    check_frames(page, drafts)
    assert page["committed"] == committed and len(committed) == whole["usage"]["completion_tokens"]
    assert page["text"] == whole["choices"][0]["text"]
    rows = browser.find_elements("css selector", "#canvas .block.done")
    assert len(rows) == len({b for b, _ in drafts})
    assert "steps" in rows[0].find_element("class name", "head").text
    assert len(browser.find_elements("css selector", "#canvas .cell.committed")) == len(committed)
    curl = browser.find_element("id", "curl").get_attribute("value")
    assert curl.startswith("curl -N " + base(server) + "/v1/completions") and '"seed":11' in curl
    assert TOKEN not in curl and "$DGSERVE_TOKEN" in curl

    replay = run_and_read_after(browser, "replay")
    assert replay["committed"] == page["committed"] and replay["text"] == page["text"]
    check_frames(replay, drafts)
    assert not errors(browser)
    shots(browser, "playground.png")


def run_and_read_after(driver, button: str) -> dict:
    canvas = driver.find_element("id", "canvas")
    driver.find_element("id", button).click()
    wait(lambda: canvas.get_attribute("data-state") in ("done", "error"))
    return {
        "log": json.loads(canvas.get_attribute("data-frame-log")),
        "committed": json.loads(canvas.get_attribute("data-committed")),
        "text": canvas.get_attribute("data-text"),
    }


BIG_SEED = "12345678901234567891"  # above 2^53: a JS number would round it to 12345678901234567168


def test_a_seed_above_2_53_is_sent_replayed_and_copied_with_its_exact_digits(server, browser):
    open_playground(browser, server)
    body = {"prompt": "Once upon a time", "max_tokens": 32, "max_denoising_steps": 6}
    set_field(browser, "prompt", body["prompt"])
    for k in ("max_tokens", "max_denoising_steps"):
        set_field(browser, k, body[k])
    set_field(browser, "seed", BIG_SEED)
    page = run_and_read(browser)
    canvas = browser.find_element("id", "canvas")
    assert canvas.get_attribute("data-seed") == BIG_SEED  # the X-Dgserve-Seed the server answered: it ran with it
    curl = browser.find_element("id", "curl").get_attribute("value")
    assert f'"seed":{BIG_SEED}}}' in curl
    _, committed = stream(server, {**body, "seed": int(BIG_SEED)})
    _, rounded = stream(server, {**body, "seed": int(float(BIG_SEED))})
    assert page["committed"] == committed != rounded  # the rounded seed is another request
    replay = run_and_read_after(browser, "replay")
    assert replay["committed"] == committed and canvas.get_attribute("data-seed") == BIG_SEED

    # no seed: the server draws one (64 bits: above 2^53 but for one draw in 2048); Replay and curl carry it
    browser.find_element("id", "seed").clear()
    page = run_and_read(browser)
    drawn = canvas.get_attribute("data-seed")
    assert drawn.isdigit() and f'"seed":{drawn}}}' in browser.find_element("id", "curl").get_attribute("value")
    _, committed = stream(server, {**body, "seed": int(drawn)})
    assert page["committed"] == committed
    assert run_and_read_after(browser, "replay")["committed"] == committed
    assert not errors(browser)


DRAFT = "The cat sat on the mat. It was a sunny day and"
DRAFT_REQUEST = {"prompt": "Once upon a time", "max_tokens": 32, "max_denoising_steps": 8, "seed": 7}


def open_playground(driver, server) -> None:
    """The playground with the token already in the tab (the first test types it)."""
    driver.get(base(server) + "/playground")
    driver.execute_script("sessionStorage.setItem('dgserve-token', arguments[0])", TOKEN)
    driver.get(base(server) + "/playground")
    wait(lambda: driver.find_element("id", "model").text, 30)


def pin(driver, first: int, last: int) -> None:
    """Click draft cell ``first`` and shift-click ``last``: pins [first, last]."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    cell = lambda k: driver.find_element("css selector", f"#draft-cells [data-k='{k}']")  # noqa: E731
    cell(first).click()
    ActionChains(driver).key_down(Keys.SHIFT).click(cell(last)).key_up(Keys.SHIFT).perform()


def check_pins(page: dict, draft: list[int], pinned: list[int]) -> None:
    """Every frame and the output hold the draft's token at each pinned position (draft position p is position
    p mod C of block p div C); some unpinned draft position shows another token in some frame."""
    C = len(page["log"][0]) - 2
    moved = 0
    for block, _step, *ids in page["log"]:
        for i, tok in enumerate(ids):
            p = block * C + i
            if p in pinned:
                assert tok == draft[p], (block, _step, i)
            elif p < len(draft) and tok != draft[p]:
                moved += 1
    assert moved > 0
    assert all(page["committed"][p] == draft[p] for p in pinned)
    assert {b for b, *_ in page["log"]} >= {p // C for p in pinned}


def test_playground_starts_from_a_draft_and_pins_stay_put(server, browser):
    open_playground(browser, server)
    draft = Tokenizer.from_pretrained(default_model_path()).encode_content(DRAFT)
    assert len(draft) > 16  # two canvases of the shipped model: the second range is in block 1
    set_field(browser, "prompt", DRAFT_REQUEST["prompt"])
    for k in ("max_tokens", "max_denoising_steps", "seed"):
        set_field(browser, k, DRAFT_REQUEST[k])
    set_field(browser, "draft", DRAFT)
    wait(lambda: len(browser.find_elements("css selector", "#draft-cells .draft-token")) == len(draft), 30)
    pin(browser, 2, 5)
    pin(browser, 13, 17)
    ranges = [[2, 6], [13, 18]]
    assert json.dumps(ranges, separators=(",", ":")) in browser.find_element("id", "pins").text
    pinned = [p for a, b in ranges for p in range(a, b)]
    assert len(browser.find_elements("css selector", "#draft-cells .pinned[aria-checked=true]")) == len(pinned)

    page = run_and_read(browser)
    canvas = browser.find_element("id", "canvas")
    assert json.loads(canvas.get_attribute("data-pinned")) == pinned
    assert json.loads(canvas.get_attribute("data-draft")) == draft
    check_pins(page, draft, pinned)
    cells = browser.find_elements("css selector", "#canvas .cell.pinned")
    assert len(cells) == len(pinned) and all("pinned to draft position" in c.get_attribute("title") for c in cells)
    # the page sent exactly the API request its curl shows: the same frames and tokens over httpx
    body = {**DRAFT_REQUEST, "initial_canvas": DRAFT, "pinned": ranges}
    drafts, committed = stream(server, body)
    check_frames(page, drafts)
    assert page["committed"] == committed
    curl = browser.find_element("id", "curl").get_attribute("value")
    assert '"initial_canvas":"The cat sat' in curl and '"pinned":[[2,6],[13,18]]' in curl
    replay = run_and_read_after(browser, "replay")
    assert replay["committed"] == page["committed"]
    check_pins(replay, draft, pinned)

    # blanks before the draft: sent as ids, the pins shift with their tokens
    set_field(browser, "blanks", 3)
    set_field(browser, "max_denoising_steps", 4)
    page = run_and_read(browser)
    shifted = [p + 3 for p in pinned]
    assert json.loads(canvas.get_attribute("data-pinned")) == shifted
    check_pins(page, [-1] * 3 + draft, shifted)
    curl = browser.find_element("id", "curl").get_attribute("value")
    assert '"initial_canvas":[-1,-1,-1,' in curl and '"pinned":[[5,9],[16,21]]' in curl
    browser.execute_script("window.scrollTo(0, 0)")
    shots(browser, "playground-draft.png")

    # pin all (no blanks): pinned true; a draft longer than the request's canvases: the server's 400 names the
    # field, and the page shows it
    set_field(browser, "blanks", 0)
    browser.find_element("id", "pin-all").click()
    set_field(browser, "max_tokens", 8)
    browser.find_element("id", "run").click()
    wait(lambda: canvas.get_attribute("data-state") == "error", 30)
    assert "initial_canvas" in browser.find_element("id", "status").text
    assert '"pinned":true' in browser.find_element("id", "curl").get_attribute("value")
    assert not [m for m in errors(browser) if "status of 400" not in m]


def test_dashboard_numbers_move_after_requests(server, browser):
    browser.get(base(server) + "/dashboard")
    tiles = browser.find_element("id", "tiles")
    wait(lambda: int(tiles.get_attribute("data-polls")) >= 1, 30)
    wait(lambda: len(browser.find_elements("css selector", "#charts canvas")) >= 6, 30)

    def tile(label: str) -> float:
        for t in browser.find_elements("css selector", "#tiles .tile"):
            if t.find_element("tag name", "span").text == label:
                return float(t.find_element("tag name", "b").get_attribute("data-value"))
        raise AssertionError(f"no tile {label!r}")

    before = {k: tile(k) for k in ("tokens generated", "requests", "blocks", "denoising steps")}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    for seed in (1, 2):
        r = httpx.post(base(server) + "/v1/completions", json={**REQUEST, "seed": seed}, headers=headers, timeout=120)
        assert r.status_code == 200
    wait(lambda: tile("requests") >= before["requests"] + 2, 30)
    assert all(tile(k) > v for k, v in before.items())
    assert not errors(browser)
    shots(browser, "dashboard.png")


def shots(driver, name: str) -> None:
    folder = os.environ.get("DGSERVE_PAGE_SHOTS")
    if folder:
        pathlib.Path(folder).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(pathlib.Path(folder) / name))
