"""The web console end to end in headless chromium against the real service: log in with a key, watch a running
job's loss curve gain points, cancel it, move an alias and see its history, see an adapter resident on a serving
worker after a request named it, a training session's metrics, and tenant B seeing none of tenant A's objects.
Each page's screenshot is written (docs/console/ too with INKWELL_CONSOLE_SCREENSHOTS=1)."""

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait

from inkwell import sdk
from inkwell.sdk.sessions import TrainingSession
from tests.service.helpers import import_dir, jsonl, make_adapter_dir, upload

EXAMPLES = [
    {"messages": [{"role": "user", "content": f"what is {i} plus {i}?"}, {"role": "assistant", "content": f"{2 * i}"}]}
    for i in range(24)
]
LONG_JOB = {
    "max_steps": 2000,  # cancelled long before
    "batch_size": 2,
    "seq_len": 64,
    "learning_rate": 5e-3,
    "checkpoint_every": 1000,
    "eval_fraction": 0.2,
    "eval_every": 3,
}
ADAPTER = "support-bot"
SESSION_STEPS = 3


def wait_for[T](driver, condition: Callable[[Any], T], timeout: float = 30.0, what: str = "") -> T:
    """`condition`'s first truthy value; tried again when the page redrew an element under it (lists refresh)."""
    stale = (NoSuchElementException, StaleElementReferenceException)
    return WebDriverWait(driver, timeout, 0.2, stale).until(lambda d: condition(d), what)


def text_of(driver, css: str) -> str:
    found = driver.find_elements(By.CSS_SELECTOR, css)
    return found[0].text if found else ""


def points(driver, series: str) -> int:
    found = driver.find_elements(By.CSS_SELECTOR, f'g[data-series="{series}"]')
    return int(found[0].get_attribute("data-points")) if found else 0


def go(driver, base: str, hash_: str) -> None:
    driver.get(f"{base}/console/{hash_}")


def log_in(driver, base: str, key: str) -> None:
    go(driver, base, "#/jobs")
    field = wait_for(driver, lambda d: d.find_element(By.ID, "key"), what="the login form")
    field.send_keys(key, Keys.ENTER)
    wait_for(driver, lambda d: d.find_element(By.ID, "nav").is_displayed(), what="the signed-in shell")


@pytest.fixture(scope="module")
def console(training_service):
    return training_service


@pytest.fixture(scope="module")
def tenant_a(console) -> tuple[str, str]:
    return console.new_tenant("console-a")


@pytest.fixture(scope="module")
def tenant_b(console) -> tuple[str, str]:
    return console.new_tenant("console-b")


@pytest.fixture(scope="module")
def api_a(console, tenant_a) -> httpx.Client:
    with console.client(tenant_a[1], timeout=180) as client:
        yield client


def submit_job(client: httpx.Client, adapter_name: str) -> dict:
    dataset = upload(client, jsonl(EXAMPLES)).json()["id"]
    body = {
        "base_model": "inkling-tiny",
        "dataset_id": dataset,
        "adapter_name": adapter_name,
        "lora": {"rank": 2, "alpha": 4, "targets": ["attn", "mlp", "experts"]},
        "hyperparameters": LONG_JOB,
    }
    resp = client.post("/v1/jobs", json=body)
    assert resp.status_code == 201, resp.text
    return resp.json()


@pytest.fixture(scope="module")
def running_job(api_a) -> dict:
    """A long job of tenant A, submitted first so the worker trains it while the browser starts."""
    return submit_job(api_a, "curves")


@pytest.fixture(scope="module")
def warm(console, tenant_a) -> Iterator[dict[str, Future]]:
    """What is slow to start, started in the background while the first tests run: the serving worker of the base
    model (a request to it) and a training session of tenant A that takes SESSION_STEPS steps."""
    ids = list(range(1, 17))
    datum = {"tokens": ids[:-1], "loss_fn_inputs": {"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}}
    with ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        client = stack.enter_context(sdk.Client(console.url, tenant_a[1], timeout=180))

        def session() -> TrainingSession:
            sn = stack.enter_context(client.sessions.create("inkling-tiny", lora={"rank": 2}))
            for _ in range(SESSION_STEPS):
                sn.forward_backward([datum]).result()
                sn.optim_step(learning_rate=1e-2).result()
            return sn

        def base_request() -> httpx.Response:
            with console.client(tenant_a[1], 180) as plain:
                return plain.post("/v1/completions", json={"model": "inkling-tiny", "prompt": "hi", "max_tokens": 2})

        yield {"serving": pool.submit(base_request), "session": pool.submit(session)}


def test_log_in_keeps_the_key_out_of_urls_and_storage(console, browser, tenant_a, running_job, warm, screenshot):
    go(browser, console.url, "#/jobs")
    field = wait_for(browser, lambda d: d.find_element(By.ID, "key"), what="the login form")
    assert browser.switch_to.active_element == field  # focused: type and press Enter
    assert not browser.find_element(By.ID, "nav").is_displayed()
    screenshot("login")
    field.send_keys("ink_not-a-key", Keys.ENTER)
    wait_for(browser, lambda d: "not accepted" in text_of(d, ".login .error"), what="the refusal")
    field.clear()
    field.send_keys(tenant_a[1], Keys.ENTER)
    wait_for(browser, lambda d: d.find_elements(By.ID, "jobs-table"), what="the jobs table")
    key = tenant_a[1]
    assert key not in browser.current_url
    assert browser.execute_script("return sessionStorage.getItem('inkwell.apiKey')") == key
    assert browser.execute_script("return localStorage.length") == 0
    assert browser.execute_script("return document.cookie") == ""


def test_keyboard_reaches_every_section(console, browser):
    for section in ("adapters", "serving", "sessions", "jobs"):
        go(browser, console.url, "#/serving" if section == "jobs" else "#/jobs")
        browser.refresh()  # focus starts at the top of the page
        wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "main h1"))
        browser.find_element(By.TAG_NAME, "body").send_keys(Keys.TAB)
        assert browser.switch_to.active_element.text == "Skip to content"
        link = browser.find_element(By.CSS_SELECTOR, f'nav a[data-section="{section}"]')
        for _ in range(6):  # Tab until the section's link has focus, then Enter
            if browser.switch_to.active_element == link:
                break
            browser.switch_to.active_element.send_keys(Keys.TAB)
        assert browser.switch_to.active_element == link, section
        link.send_keys(Keys.ENTER)
        wait_for(browser, lambda d, s=section: d.current_url.endswith(f"#/{s}"))
        wait_for(browser, lambda d, a=link: a.get_attribute("aria-current") == "page", what="marked current")
        wait_for(browser, lambda d: d.switch_to.active_element.get_attribute("id") == "main", what="focus on the page")


def cancel(browser) -> None:
    browser.find_element(By.ID, "cancel-job").click()
    wait_for(browser, lambda d: d.find_element(By.ID, "confirm-cancel")).click()
    wait_for(browser, lambda d: text_of(d, "#job-state").startswith("cancelled"), 60, "the job cancelled")
    assert not browser.find_elements(By.ID, "cancel-job")
    wait_for(browser, lambda d: "cancelled" in text_of(d, "#events"), what="the cancel among the events")


def open_job(browser, job_id: str) -> None:
    """Follow the job's link in the list (the list redraws as steps land)."""
    wait_for(browser, lambda d: d.find_element(By.LINK_TEXT, job_id).send_keys(Keys.ENTER) or True)
    wait_for(browser, lambda d: d.find_elements(By.ID, "job-state"))


def test_a_queued_job_is_cancelled_at_once(console, browser, api_a, running_job):
    queued = submit_job(api_a, "behind")  # the one worker trains `running_job` first
    go(browser, console.url, "#/jobs")
    Select(browser.find_element(By.ID, "f-state")).select_by_value("queued")  # the filter applies on change
    states = "#jobs-table [data-state]"
    wait_for(
        browser,
        lambda d: (
            d.find_elements(By.LINK_TEXT, queued["id"])
            and {e.get_attribute("data-state") for e in d.find_elements(By.CSS_SELECTOR, states)} == {"queued"}
        ),
        what="queued jobs only",
    )
    open_job(browser, queued["id"])
    cancel(browser)


def test_a_running_jobs_curve_gains_points_and_it_can_be_cancelled(console, browser, running_job, screenshot):
    job_id = running_job["id"]
    go(browser, console.url, "#/jobs")
    Select(browser.find_element(By.ID, "f-state")).select_by_value("")
    wait_for(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#jobs-table [data-state=running]"), 60, "running")
    wait_for(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#jobs-table [data-state=cancelled]"))
    open_job(browser, job_id)
    wait_for(browser, lambda d: points(d, "loss") >= 2, 60, "two steps on the curve")
    first = points(browser, "loss")
    wait_for(browser, lambda d: points(d, "loss") >= first + 3, 60, "more steps landing on the curve")
    wait_for(browser, lambda d: points(d, "eval_loss") >= 2, 60, "eval points")
    assert "learning_rate" in text_of(browser, "#hyperparameters")
    assert "progress" in text_of(browser, "#events")
    screenshot("job")
    cancel(browser)
    go(browser, console.url, "#/jobs")
    wait_for(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#jobs-table [data-state=cancelled]")) == 2)
    screenshot("jobs")


def test_an_alias_moves_and_its_history_shows_it(console, browser, api_a, screenshot, tmp_path_factory):
    out = tmp_path_factory.mktemp("adapters")
    for seed in (1, 2):
        directory = make_adapter_dir(console, out / f"v{seed}", "sglang", seed=seed)
        assert import_dir(api_a, directory, ADAPTER, "sglang").status_code == 201
    go(browser, console.url, f"#/adapters/{ADAPTER}")
    wait_for(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#versions-table [data-version]")) == 2)

    def set_alias(alias: str, version: int) -> None:
        name = browser.find_element(By.ID, "alias-name")
        name.clear()
        name.send_keys(alias)
        browser.find_element(By.CSS_SELECTOR, f'#alias-version option[value="{version}"]').click()
        browser.find_element(By.ID, "alias-set").click()
        shown = f'[data-alias-version="{alias}"]'
        wait_for(browser, lambda d: text_of(d, shown) == str(version), what=f"{alias} at {version}")

    set_alias("prod", 1)
    set_alias("prod", 2)
    wait_for(browser, lambda d: "1 → 2" in text_of(d, "#alias-history"), what="the move in the history")
    assert "set to 1" in text_of(browser, "#alias-history")
    browser.find_element(By.CSS_SELECTOR, 'button[aria-label="Files of version 2"]').click()
    files = wait_for(browser, lambda d: text_of(d, "#files-panel"))
    version = api_a.get(f"/v1/adapters/{ADAPTER}/versions/2").json()
    for f in version["files"]:  # both layouts, every file with its full sha256
        assert f["sha256"] in files and f["layout"] in files
    screenshot("adapters")
    go(browser, console.url, "#/adapters")
    wait_for(browser, lambda d: "prod → 2" in text_of(d, "#adapters-table"))


def test_an_adapter_appears_on_a_serving_worker_after_a_request_names_it(console, browser, api_a, warm, screenshot):
    assert warm["serving"].result().status_code == 200  # the worker is up, with no adapter of A's yet
    go(browser, console.url, "#/serving")
    wait_for(browser, lambda d: "none of yours" in text_of(d, "#workers-table"), what="the worker")
    body = {"model": f"inkling-tiny:{ADAPTER}@prod", "prompt": "hi", "max_tokens": 4}
    resp = api_a.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    chip = wait_for(browser, lambda d: d.find_element(By.CSS_SELECTOR, f'[data-adapter="{ADAPTER}@2"]'), 30)
    assert chip.text == f"{ADAPTER}@2"
    row = text_of(browser, "#workers-table tbody tr")
    assert "inkling-tiny-0" in row and "cpu" in row
    screenshot("serving")


def test_a_sessions_metrics_over_steps(console, browser, warm, screenshot):
    sn = warm["session"].result()
    go(browser, console.url, "#/sessions")
    wait_for(browser, lambda d: d.find_element(By.LINK_TEXT, sn.id)).send_keys(Keys.ENTER)
    loss = "forward_backward loss:sum"
    wait_for(browser, lambda d: points(d, loss) == SESSION_STEPS, what="a loss per step")
    assert text_of(browser, "#session-step").startswith(f"step {SESSION_STEPS}")
    screenshot("sessions")


def test_tenant_b_sees_none_of_tenant_as_objects(console, browser, tenant_b, running_job, warm):
    browser.find_element(By.ID, "logout").click()
    log_in(browser, console.url, tenant_b[1])
    wait_for(browser, lambda d: "No jobs yet" in d.find_element(By.TAG_NAME, "main").text)
    go(browser, console.url, f"#/jobs/{running_job['id']}")
    wait_for(browser, lambda d: "Not found" in text_of(d, "main .error"))
    for section, nothing in (("adapters", "No adapters yet"), ("sessions", "No training sessions")):
        go(browser, console.url, f"#/{section}")
        wait_for(browser, lambda d, n=nothing: n in d.find_element(By.TAG_NAME, "main").text, what=section)
    go(browser, console.url, "#/serving")
    wait_for(browser, lambda d: "none of yours" in text_of(d, "#workers-table"), what="the worker without A's adapter")
    assert ADAPTER not in browser.find_element(By.TAG_NAME, "main").text
    with console.client(tenant_b[1]) as api_b:  # the routes the pages read answer B as the API does
        assert api_b.get(f"/v1/sessions/{warm['session'].result().id}/history").status_code == 404
        assert all(not w["adapters"] for w in api_b.get("/v1/serving/workers").json()["data"])


def test_narrow_window_has_no_sideways_scroll(console, browser, tenant_a, running_job, screenshot):
    browser.find_element(By.ID, "logout").click()
    log_in(browser, console.url, tenant_a[1])
    browser.set_window_size(420, 900)
    try:
        go(browser, console.url, f"#/jobs/{running_job['id']}")
        wait_for(browser, lambda d: points(d, "loss") > 0)
        time.sleep(0.3)  # the chart redraws within 100 ms
        overflow = browser.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0
        screenshot("job-narrow")
    finally:
        browser.set_window_size(1280, 900)
