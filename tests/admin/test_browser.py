"""One operator session in a real headless Chromium against the live server: log in
through the form, filter the deliveries by status, open one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

from tests.support import factories
from workflow_delivery import services

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PASSWORD = "a-local-test-password"


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[webdriver.Chrome]:
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not path.exists()]
    if missing:
        pytest.fail(
            f"{', '.join(missing)} missing: install Debian's chromium and chromium-driver "
            "(scripts/test does it when run as root)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in [*FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]:
        options.add_argument(flag)
    # An explicit driver path: Selenium Manager never runs, so nothing is downloaded.
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.mark.browser
def test_operator_logs_in_filters_by_status_and_opens_a_delivery(
    browser, live_server, django_user_model
):
    django_user_model.objects.create_superuser("operator", password=PASSWORD)
    step = factories.Step(targets=2)
    services.commit_deliveries(step.community.id, step.created_at, step.new_deliveries())
    _, claimed = services.claim_delivery(step.community.id, step.targets[1])
    wait = WebDriverWait(browser, 30)

    browser.get(f"{live_server.url}/admin/workflow_delivery/workflowagentdelivery/")
    browser.find_element(By.NAME, "username").send_keys("operator")
    browser.find_element(By.NAME, "password").send_keys(PASSWORD)
    browser.find_element(By.CSS_SELECTOR, "#login-form [type=submit]").click()
    wait.until(expected_conditions.presence_of_element_located((By.ID, "result_list")))
    assert len(browser.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")) == 2

    status_filter = browser.find_element(By.CSS_SELECTOR, '[data-filter-title="status"]')
    status_filter.find_element(By.LINK_TEXT, "claimed").click()
    wait.until(expected_conditions.url_contains("status__exact=claimed"))
    rows = browser.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")
    assert len(rows) == 1

    rows[0].find_element(By.CSS_SELECTOR, "th a").click()
    wait.until(expected_conditions.url_contains(f"/{claimed.id}/change/"))
    detail = browser.find_element(By.ID, "content").text
    assert str(claimed.id) in detail
    assert step.targets[1].hex() in detail
    assert "claimed" in detail


SCREENSHOTS = Path(__file__).resolve().parents[1] / "screenshots"


@pytest.fixture
def screenshots(request) -> Path:
    """A folder named by the test for a person to look at (git-ignored)."""
    folder = SCREENSHOTS / request.node.name
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.png"):
        old.unlink()
    return folder


def log_in(browser: webdriver.Chrome, live_server, path: str) -> None:
    browser.get(f"{live_server.url}{path}")
    browser.find_element(By.NAME, "username").send_keys("operator")
    browser.find_element(By.NAME, "password").send_keys(PASSWORD)
    browser.find_element(By.CSS_SELECTOR, "#login-form [type=submit]").click()


@pytest.mark.browser
def test_operator_reads_the_overview_the_list_at_1400px_and_a_timeline(
    browser, live_server, django_user_model, screenshots
):
    django_user_model.objects.create_superuser("operator", password=PASSWORD)
    step = factories.Step(targets=3)
    services.commit_deliveries(step.community.id, step.created_at, step.new_deliveries())
    lease, record = services.claim_delivery(step.community.id, step.targets[0])
    services.finish_delivery(lease, "finished")
    services.claim_delivery(step.community.id, step.targets[1])
    wait = WebDriverWait(browser, 30)
    browser.set_window_size(1400, 900)

    log_in(browser, live_server, "/admin/workflow_delivery/workflowagentdelivery/overview/")
    wait.until(expected_conditions.presence_of_element_located((By.ID, "wd-communities")))
    row = browser.find_element(By.CSS_SELECTOR, f'tr[data-community="{step.community.host}"]')
    counts = {
        cell.get_attribute("data-status"): cell.text
        for cell in row.find_elements(By.CSS_SELECTOR, "td[data-status]")
    }
    assert counts == {"pending": "1", "claimed": "1", "finished": "1", "failed": "0"}
    plot = browser.find_element(By.CSS_SELECTOR, "svg.wd-settles")
    assert plot.size["width"] > 600 and plot.size["height"] > 100
    assert len(plot.find_elements(By.TAG_NAME, "rect")) == 60
    browser.save_screenshot(str(screenshots / "overview.png"))

    browser.get(f"{live_server.url}/admin/workflow_delivery/workflowagentdelivery/")
    wait.until(expected_conditions.presence_of_element_located((By.ID, "result_list")))
    browser.save_screenshot(str(screenshots / "list-1400px.png"))
    # The list fits the window: no horizontal scrollbar, one short line per row.
    for element in ("document.documentElement", "document.querySelector('#changelist .results')"):
        overflow = browser.execute_script(
            f"const e = {element}; return e.scrollWidth - e.clientWidth"
        )
        assert overflow <= 0, element
    heights = [
        r.size["height"] for r in browser.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")
    ]
    assert heights and max(heights) < 50

    browser.find_element(By.NAME, "q").send_keys(step.targets[0].hex()[:12] + "\n")
    wait.until(expected_conditions.url_contains("q="))
    rows = browser.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")
    assert len(rows) == 1
    rows[0].find_element(By.CSS_SELECTOR, "th a").click()
    wait.until(expected_conditions.url_contains(f"/{record.id}/change/"))
    timeline = browser.find_element(By.CSS_SELECTOR, "table.wd-timeline")
    kinds = [
        line.find_elements(By.TAG_NAME, "td")[1].text
        for line in timeline.find_elements(By.CSS_SELECTOR, "tbody tr")
    ]
    assert kinds == ["committed", "claimed", "finished"]
    browser.execute_script("arguments[0].scrollIntoView()", timeline)
    browser.save_screenshot(str(screenshots / "timeline.png"))


@pytest.mark.browser
def test_operator_follows_a_deliverys_link_to_why_it_is_not_delivered(
    browser, live_server, django_user_model, screenshots
):
    django_user_model.objects.create_superuser("operator", password=PASSWORD)
    step = factories.Step(targets=1)
    (delivery_id,) = services.commit_deliveries(
        step.community.id, step.created_at, step.new_deliveries()
    )
    lease, _ = services.claim_delivery(step.community.id, step.targets[0])
    services.retry_delivery(lease, error=KeyError("step_id"), delay_seconds=600)
    wait = WebDriverWait(browser, 30)
    browser.set_window_size(1400, 900)

    log_in(
        browser,
        live_server,
        f"/admin/workflow_delivery/workflowagentdelivery/{delivery_id}/change/",
    )
    wait.until(
        expected_conditions.presence_of_element_located((By.CSS_SELECTOR, "a.wd-target-link"))
    )
    browser.find_element(By.CSS_SELECTOR, "a.wd-target-link").click()
    verdict = wait.until(
        expected_conditions.presence_of_element_located((By.CSS_SELECTOR, "p.wd-verdict"))
    )
    assert verdict.get_attribute("data-verdict") == "backoff"
    assert verdict.text.startswith("1 delivery is waiting for its retry backoff until ")
    error = browser.find_element(By.CSS_SELECTOR, 'td[data-figure="last-error"]')
    assert error.text.startswith("KeyError: ")
    browser.save_screenshot(str(screenshots / "target.png"))
