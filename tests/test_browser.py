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

from tests import factories
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
