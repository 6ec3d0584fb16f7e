"""The web view in a real headless Chromium (docs/web-view.md): API subprocess, real workers, real keys.

Screenshots go to each test's tmp dir; with RLM_UI_SCREENSHOT_DIR set, the two documented ones
(docs/img/job-running.png, docs/img/job-done.png) are written there too.
"""

from __future__ import annotations

import os
import re
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from tests.support.api import Api
from tests.support.workers import WorkerProcess

pytestmark = pytest.mark.slow

DOCS = [
    {"path": "guide/retries.md", "text": "# Retries\n\nFailed uploads are retried three times with backoff.\n"},
    {"path": "guide/limits.md", "text": "# Limits\n\nEach account may store at most fifty gigabytes.\n"},
    {"path": "guide/keys.md", "text": "# Keys\n\nAPI keys are created with rlm keys create and revoked later.\n"},
]
#: a two-hop question: the first round's finding names Zephyrine, a follow-up job finds where it stores data
HOPS = [
    {"path": "teams.md", "text": "# Teams\n\nThe billing team maintains the Zephyrine service.\n"},
    {"path": "storage.md", "text": "# Storage\n\nZephyrine writes every ledger into the Quokka cluster.\n"},
]
SCRIPT = "<script>alert('chunk')</script>"
IMG = "<img src=x onerror=alert('img')>"
EVIL = [{"path": "evil/widget.md", "text": f"# Widget\n\nThe widget template contains {SCRIPT} and {IMG} verbatim.\n"}]
#: a Python package: its paths hold "__", which markdown would read as emphasis
CODE = [
    {
        "path": "kombu/__init__.py",
        "text": '"""Messaging library for Python."""\n\nPOOL_LIMIT = 10  # the kombu connection pool limit\n',
    }
]
#: a long path, and a sentence whose quote (over a snippet's 300 characters) holds a path in bold
WIDE_PATH = "deploy/settings/reference/broker_connection_settings_reference_for_operators.md"
WIDE = [
    {
        "path": WIDE_PATH,
        "text": "# Broker connection\n\nThe broker connection retry setting lives in **/etc/default/celeryd** on every "
        "host, where CELERYD_OPTS passes it to each worker at start, and an operator who changes it restarts the "
        "workers one at a time so that the queue keeps draining while the broker connection retry setting takes "
        "effect across the whole cluster without a lost task.\n",
    }
]
#: every scripted job: no planner call, every chunk past search, one chunk a batch (a grid of several cells)
OPTIONS = '{"skip_plan": true, "threshold": -1.0, "batch_size": 1}'


def _chromium() -> str | None:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    return found or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)


@pytest.fixture(scope="module")
def browser():
    chromium = _chromium()
    if chromium is None:
        pytest.skip("chromium not installed: apt-get install -y chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def env(rlm_env):
    return {**rlm_env, "HF_HUB_OFFLINE": "1", "RLM_FLOWER_URL": "http://flower.test:5555/"}


@pytest.fixture(scope="module")
def keys(env, conn):
    from rlm_api.auth import create_key

    made = {"a": create_key(conn, tenant="acme")[0], "b": create_key(conn, tenant="globex")[0]}
    conn.commit()
    return made


@pytest.fixture(scope="module")
def api(env, keys, tmp_path_factory):
    import redis

    redis.Redis.from_url(env["RLM_BROKER_URL"]).flushdb()
    server = Api(env, tmp_path_factory.mktemp("ui-api") / "api.log")
    with server.client(keys["a"]) as c:
        for name, docs in (("handbook", DOCS), ("evil", EVIL), ("hops", HOPS), ("code", CODE), ("wide", WIDE)):
            r = c.post("/v1/buffers", json={"name": name, "documents": docs})
            assert r.status_code == 201, r.text
    yield server
    server.stop()


@pytest.fixture(scope="module")
def control(env, api, tmp_path_factory):
    w = WorkerProcess("uictl", queues="rlm.control", env=env, log_dir=tmp_path_factory.mktemp("ui-w")).start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def analysts(env, control, tmp_path_factory):
    w = WorkerProcess("uian", queues="rlm.analyst", env=env, log_dir=tmp_path_factory.mktemp("ui-w2")).start()
    yield w
    w.stop()


@pytest.fixture
def page(browser, tmp_path):
    context = browser.new_context(viewport={"width": 1100, "height": 900})
    pg = context.new_page()
    pg.dialogs = []  # any alert() an injected script managed to run
    pg.on("dialog", lambda d: (pg.dialogs.append(d.message), d.dismiss()))
    pg.set_default_timeout(30_000)
    yield pg
    pg.screenshot(path=str(tmp_path / "last.png"), full_page=True)
    context.close()


def shot(page, tmp_path: Path, name: str) -> None:
    page.screenshot(path=str(tmp_path / f"{name}.png"), full_page=True)
    if os.environ.get("RLM_UI_SCREENSHOT_DIR"):
        page.screenshot(path=str(Path(os.environ["RLM_UI_SCREENSHOT_DIR"]) / f"{name}.png"), full_page=True)


def sign_in(page, api, key: str) -> None:
    page.goto(f"{api.base}/ui/signin")
    page.fill("#key", key)
    page.click("#signin-form button[type=submit]")
    page.wait_for_url(f"{api.base}/ui/")


def submit(page, api, query: str, buffer: str, options: str = OPTIONS) -> str:
    page.goto(f"{api.base}/ui/")
    page.wait_for_selector(f"#q-buffers option[value='{buffer}']", state="attached")
    page.fill("#q-query", query)
    page.select_option("#q-buffers", [buffer])
    page.fill("#q-options", options)
    page.click("#submit-form button[type=submit]")
    page.wait_for_url(re.compile(r".*/ui/jobs/[^/]+$"))
    return page.url.rsplit("/", 1)[1]


def wait_status(page, status: str, timeout: float = 120_000) -> None:
    page.wait_for_function("s => document.getElementById('job-status').textContent === s", arg=status, timeout=timeout)


def test_sign_in_refuses_a_wrong_key_and_keeps_the_key_out_of_urls(page, api, keys):
    page.goto(f"{api.base}/ui/")
    page.wait_for_url(re.compile(r".*/ui/signin\?next=.*"))  # no key yet: the sign-in page
    page.fill("#key", "rlm_not_a_key")
    page.click("#signin-form button[type=submit]")
    page.wait_for_selector("#signin-error:not([hidden])")
    assert "refused" in page.text_content("#signin-error")
    sign_in(page, api, keys["a"])
    assert keys["a"] not in page.url
    assert page.evaluate("document.cookie") == ""
    assert page.evaluate("sessionStorage.getItem('rlm.key')") == keys["a"]
    # A key that stops working mid-session: back to the sign-in page, saying why. The key is swapped on the
    # sign-in page, which does not poll: on the jobs page a poll's 401 redirect would race the goto below.
    page.goto(f"{api.base}/ui/signin")
    page.evaluate("sessionStorage.setItem('rlm.key', 'rlm_revoked_meanwhile')")
    page.goto(f"{api.base}/ui/buffers")
    page.wait_for_url(re.compile(r".*/ui/signin\?next=%2Fui%2Fbuffers"))
    page.wait_for_selector("#signin-error:not([hidden])")
    assert "sign in again" in page.text_content("#signin-error")
    # A second arrival before a key is accepted (a poll's 401 racing a page load redirects twice) keeps the reason.
    page.reload()
    page.wait_for_selector("#signin-error:not([hidden])")
    assert "sign in again" in page.text_content("#signin-error")
    r = httpx.get(f"{api.base}/ui/signin")
    assert "script-src 'self'" in r.headers["content-security-policy"] and "<script>" not in r.text


def test_cancel_a_running_job(page, api, keys, control, tmp_path):
    # Only the control worker runs: the chord's analyst tasks wait on their queue, so the job stays running.
    sign_in(page, api, keys["a"])
    job_id = submit(page, api, "How are uploads retried?", "handbook")
    wait_status(page, "running")
    page.wait_for_selector("#grid .cell.queued")
    assert page.is_visible("#cancel")
    # the batches are stored before the chord is sent and its task ids with it: the next poll shows them
    page.wait_for_selector("#tasks a")
    tasks = page.locator("#tasks a")
    assert tasks.count() >= 1 and tasks.first.get_attribute("href").startswith("http://flower.test:5555/task/")
    shot(page, tmp_path, "job-running")
    page.click("#cancel")
    wait_status(page, "cancelled")
    assert page.is_hidden("#cancel")
    with api.client(keys["a"]) as c:
        assert c.get(f"/v1/queries/{job_id}").json()["status"] == "cancelled"


def test_submit_watch_the_grid_fill_and_open_a_citation(page, api, keys, analysts, tmp_path):
    sign_in(page, api, keys["a"])
    job_id = submit(page, api, "How many times are failed uploads retried?", "handbook")
    wait_status(page, "done")
    cells = page.locator("#grid .cell")
    assert cells.count() == 3 and page.locator("#grid .cell.done").count() == 3
    assert "done" in cells.first.get_attribute("title")
    cells.first.click()
    assert page.text_content("#batch-detail").startswith("batch ")
    page.wait_for_selector("#report a.cite")
    assert page.locator("#timings tbody tr").count() >= 3
    assert page.locator("#calls tbody tr").count() >= 1
    cite = page.locator("#report a.cite", has_text="guide/retries.md").first
    cite.click()
    page.wait_for_selector("#chunk:not([hidden])")
    page.wait_for_function(
        "() => /guide\\/retries\\.md:\\d+-\\d+/.test(document.getElementById('chunk-title').textContent)"
    )
    assert "handbook" in page.text_content("#chunk-title")
    assert "retried three times" in page.text_content("#chunk-text")
    shot(page, tmp_path, "job-done")
    # The jobs list shows it, filters find it, and the overnight batch list shows item counts.
    with api.client(keys["a"]) as c:
        run_at = (datetime.now(UTC) + timedelta(days=1)).isoformat()
        r = c.post("/v1/batches", json={"queries": ["q one", "q two"], "buffers": ["handbook"], "run_at": run_at})
        assert r.status_code in (201, 202), r.text
        batch_id = r.json()["batch_id"]
    page.goto(f"{api.base}/ui/")
    row = page.locator(f"#jobs tr[data-job='{job_id}']")
    row.wait_for()
    assert "done" in row.inner_text() and "handbook" in row.inner_text()
    page.fill("#f-text", "nothing matches this")
    page.click("#filter-form button[type=submit]")
    page.wait_for_selector("#jobs-empty:not([hidden])")
    batch = page.locator(f"#batches tr[data-batch='{batch_id}']")
    batch.wait_for()
    assert "pending 2" in batch.inner_text()


def test_untrusted_text_renders_as_text(page, api, keys, analysts):
    sign_in(page, api, keys["a"])
    submit(page, api, f"What does the widget template contain? {IMG}", "evil")
    wait_status(page, "done")
    assert page.text_content("#job-query").endswith(IMG)  # the query itself, as text
    page.wait_for_selector("#report a.cite")
    page.locator("#report a.cite", has_text="evil/widget.md").first.click()
    page.wait_for_function("() => document.getElementById('chunk-text').textContent.includes('widget')")
    text = page.text_content("#chunk-text")
    assert SCRIPT in text and IMG in text
    assert page.locator("main img").count() == 0 and page.locator("main script").count() == 0
    assert page.dialogs == []


def test_a_citation_of_a_dunder_path_shows_the_path_and_opens_the_chunk(page, api, keys, analysts):
    sign_in(page, api, keys["a"])
    submit(page, api, "Where is the kombu connection pool limit set?", "code")
    wait_status(page, "done")
    page.wait_for_selector("#report a.cite")
    cite = page.locator("#report a.cite", has_text="kombu/__init__.py").first
    assert re.fullmatch(r"\[chunk \d+, code:kombu/__init__\.py:\d+-\d+\]", cite.text_content())
    assert page.locator("#report a.cite strong, #report a.cite em").count() == 0
    cite.click()
    page.wait_for_selector("#chunk:not([hidden])")
    page.wait_for_function("() => document.getElementById('chunk-title').textContent.includes('kombu/__init__.py')")
    assert "POOL_LIMIT = 10" in page.text_content("#chunk-text")


def _box(page, selector: str) -> dict:
    return page.evaluate(
        "s => { const r = document.querySelector(s).getBoundingClientRect();"
        " return {left: r.left, right: r.right, top: r.top, bottom: r.bottom, width: r.width, window: innerWidth}; }",
        selector,
    )


def test_a_wide_window_shows_the_report_wide_with_its_markdown_and_whole_paths(browser, api, keys, analysts, tmp_path):
    context = browser.new_context(viewport={"width": 1920, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(30_000)
    try:
        sign_in(page, api, keys["a"])
        submit(page, api, "Where does the broker connection retry setting live?", "wide")
        wait_status(page, "done")
        page.wait_for_selector("#report a.cite")
        # the quote's bold path is bold, not shown between literal stars
        assert page.locator("#report strong", has_text="/etc/default/celeryd").count() >= 1
        assert "**" not in page.text_content("#report")
        # the report uses the wide window, not a column of 80 characters in its middle
        report = _box(page, "#report")
        assert report["width"] >= 0.75 * report["window"], report
        # an opened citation sits beside the report
        page.locator("#report a.cite", has_text=WIDE_PATH).first.click()
        page.wait_for_function("p => document.getElementById('chunk-title').textContent.includes(p)", arg=WIDE_PATH)
        chunk, report = _box(page, "#chunk"), _box(page, "#report")
        assert chunk["left"] >= report["right"] and chunk["top"] < report["bottom"], (chunk, report)
        shot(page, tmp_path, "job-wide")
        # a source: its citation shows the whole path, and its snippet is cut after a word, marked
        source = page.locator("#sources li", has_text=WIDE_PATH).first
        assert WIDE_PATH in source.locator("a.cite").text_content()
        snippet = source.locator(".snippet").text_content()
        assert snippet.endswith(" …") and "broker_connection_settings" not in snippet, snippet
        # in a narrow window the path wraps inside its card and a snippet the box cuts shows an ellipsis
        page.set_viewport_size({"width": 560, "height": 900})
        clipped = page.evaluate(
            "() => [...document.querySelectorAll('#sources li')].map(li => {"
            " const s = li.querySelector('.snippet'), st = s && getComputedStyle(s);"
            " return {overflows: li.scrollWidth > li.clientWidth + 1,"
            " cutUnmarked: !!s && s.scrollHeight > s.clientHeight + 1 && st.webkitLineClamp === 'none'}; })"
        )
        assert clipped and not any(c["overflows"] or c["cutUnmarked"] for c in clipped), clipped
    finally:
        page.screenshot(path=str(tmp_path / "wide-last.png"), full_page=True)
        context.close()


def test_a_thinking_jobs_follow_ups_show_as_a_tree(page, api, keys, analysts):
    sign_in(page, api, keys["a"])
    root = submit(
        page, api, "Where does the billing team's service store data?", "hops", options='{"mode": "thinking"}'
    )
    wait_status(page, "done", timeout=240_000)
    page.wait_for_selector("#children-card:not([hidden]) #children li a")
    child = page.locator("#children li a").first
    assert "Zephyrine" in child.inner_text()
    child.click()
    page.wait_for_url(re.compile(r".*/ui/jobs/[^/]+$"))
    page.wait_for_selector("#job-parent:not([hidden])")
    assert page.text_content("#job-parent-link") == root
    page.wait_for_function("() => document.getElementById('report').textContent.includes('follow-up job')")


def test_a_code_mode_jobs_rounds_show_as_a_trace_of_text(page, api, keys, analysts, conn):
    from rlm_workers.models import CodeRound
    from rlm_workers.store.code import save_round

    sign_in(page, api, keys["a"])
    job_id = submit(page, api, "How many widgets are there?", "evil", options='{"mode": "code"}')
    wait_status(page, "failed")  # no model here to write programs: the job says so
    assert "needs a model that writes programs" in page.text_content("#job-error")
    # the rounds a model's programs would have left, written by the store as the code stage writes them
    save_round(conn, job_id=job_id, entry=CodeRound(round=1, code=f"print('{SCRIPT}')", output=f"{IMG}\n", calls=1))
    save_round(
        conn,
        job_id=job_id,
        entry=CodeRound(round=2, code="x = 1 / 0", output="y" * 50, output_chars=9000, error="ZeroDivisionError"),
    )
    conn.commit()
    page.reload()
    page.wait_for_selector("#rounds-card:not([hidden]) #rounds li[data-round='2']")
    programs = page.locator("#rounds pre.program").all_text_contents()
    assert programs == [f"print('{SCRIPT}')", "x = 1 / 0"]
    outputs = page.locator("#rounds pre.output").all_text_contents()
    assert outputs[0] == f"{IMG}\n" and outputs[1].endswith("[first 50 of 9000 characters]")
    assert page.text_content("#rounds pre.error") == "ZeroDivisionError"
    assert page.locator("main img").count() == 0 and page.locator("main script").count() == 0
    assert page.dialogs == []


def test_buffers_files_and_upload(page, api, keys, tmp_path):
    sign_in(page, api, keys["a"])
    page.goto(f"{api.base}/ui/buffers")
    row = page.locator("#buffers tr[data-buffer='handbook']")
    row.wait_for()
    assert row.locator("td").nth(1).inner_text() == "3"
    row.locator("a").click()
    page.wait_for_selector("#files tbody tr")
    assert "guide/keys.md" in page.inner_text("#files")
    upload = tmp_path / "notes.md"
    upload.write_text("# Notes\n\nThe ferry leaves at nine.\n")
    page.goto(f"{api.base}/ui/buffers")
    page.fill("#u-name", "notes")
    page.set_input_files("#u-files", str(upload))
    page.click("#upload-form button[type=submit]")
    page.wait_for_function("() => document.getElementById('upload-result').textContent.startsWith('Loaded')")
    page.locator("#buffers tr[data-buffer='notes']").wait_for()


def test_another_tenants_job_is_not_found(page, api, keys):
    with api.client(keys["a"]) as c:
        r = c.post("/v1/queries", json={"query": "Acme's own question", "buffers": ["handbook"]})
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]
    with api.client(keys["b"]) as c:
        assert c.get(f"/v1/queries/{job_id}/report").status_code == 404
    sign_in(page, api, keys["b"])
    page.goto(f"{api.base}/ui/jobs/{job_id}")
    page.wait_for_selector("#job-missing:not([hidden])")
    assert page.is_hidden("#job") and "Acme's own question" not in page.content()
    page.goto(f"{api.base}/ui/")
    page.wait_for_selector("#jobs-empty:not([hidden])")


def test_report_html_escapes_markup_and_links_citations():
    from rlm_api.ui.render import report_html

    html = report_html(
        f"See [chunk 12, a<b>.md:1-3] and [chunk 4]. {SCRIPT} {IMG} [x](javascript:alert(1)) "
        "[y](https://example.com/) ![p](https://example.com/p.png) `[chunk 9]`"
    )
    assert '<a class="cite" data-chunk="12" href="#chunk-12">[chunk 12, a&lt;b&gt;.md:1-3]</a>' in html
    assert '<a class="cite" data-chunk="4" href="#chunk-4">[chunk 4]</a>' in html
    assert "<script" not in html and "<img" not in html and "&lt;script&gt;" in html
    assert 'href="javascript' not in html and 'href="https://example.com/"' in html
    assert "<code>[chunk 9]</code>" in html  # a citation in a code span stays code
