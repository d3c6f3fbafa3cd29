"""Real browser (a Chromium through Playwright; see browsers.py for where it is found) against
the real app server: log in, upload an image, see k labelled results per index; run the probes tab."""
from __future__ import annotations

import pytest

from serving_testlib import labelled_folder

pytestmark = pytest.mark.browser

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--no-first-run", "--disable-sync"]


@pytest.fixture(scope="module")
def page(chromium, server):          # chromium first: no browser, no server started for nothing
    from playwright.sync_api import sync_playwright

    url, auth = server
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=ARGS)
        try:
            pg = browser.new_page(viewport={"width": 1400, "height": 1000})
            pg.set_default_timeout(60_000)
            pg.goto(url + "/")
            pg.get_by_label("username").fill(auth[0])
            pg.get_by_label("password").fill(auth[1])
            pg.get_by_role("button", name="Login").click()
            pg.wait_for_selector("#search-btn")
            yield pg
        finally:
            browser.close()


def test_upload_and_search_shows_k_labelled_results(page, demo_dirs):
    path, label = labelled_folder(demo_dirs[1])[0]
    k = 5
    page.get_by_role("tab", name="Search").click()      # the page is the module's: another test may have left another tab open
    page.locator("#search-image input[type=file]").set_input_files(str(path))
    page.wait_for_selector("#search-image img")
    slider = page.locator("#search-k input[type=number]")
    slider.fill(str(k))
    slider.press("Enter")
    page.locator("#search-btn").click()
    for gal in ("#search-results-0", "#search-results-1"):     # both indexes, side by side
        page.wait_for_function(f"document.querySelectorAll('{gal} .gallery-item img').length === {k}")
    captions = page.locator("#search-results-0 .caption-label").all_inner_texts()
    assert len(captions) == k
    assert captions[0].startswith(label)                 # label and score under each image
    assert all(" · " in c and float(c.rsplit(" · ", 1)[1]) <= 1.0 for c in captions)
    imgs = page.locator("#search-results-0 .gallery-item img")
    # The <img> elements appear before their bytes arrive: wait for them to load (times out,
    # and fails, if a thumbnail never renders), then check each one.
    page.wait_for_function("Array.from(document.querySelectorAll('#search-results-0 .gallery-item img'))"
                           ".every(e => e.complete && e.naturalWidth > 0)")
    assert all(imgs.nth(i).evaluate("e => e.complete && e.naturalWidth > 0") for i in range(k))
    assert path.name in page.locator("#search-status").inner_text()


def _search_until(page, text: str, tries: int = 6) -> str:
    """Click Search until the status holds ``text``; the status then. A "more images" upload ends
    in the background (the File component shows it in its own way), so a click before it ends
    searches without it."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for _ in range(tries):
        page.locator("#search-btn").click()
        try:
            page.wait_for_function(f"document.querySelector('#search-status').innerText.includes({text!r})",
                                   timeout=10_000)
            break
        except PlaywrightTimeout:
            continue
    return page.locator("#search-status").inner_text()


def test_a_phones_heic_photo_is_searched_from_the_browser(page, demo_dirs, tmp_path):
    """An iPhone's HEIC, which the image box refuses (Gradio checks the browser's MIME type),
    given as "more query images" alone is decoded by the server and searched: its class first."""
    import pillow_heif
    from PIL import Image

    path, label = labelled_folder(demo_dirs[1])[0]
    heic = tmp_path / "IMG_0001.HEIC"
    pillow_heif.from_pillow(Image.open(path).convert("RGB")).save(heic, quality=85)
    page.get_by_role("tab", name="Search").click()
    image_clear = page.locator("#search-image button[aria-label='Remove Image']")
    if image_clear.count():                       # an earlier test's query image: this one is alone
        image_clear.first.click()
    try:
        page.locator("#search-more input[type=file]").set_input_files(str(heic))
        status = _search_until(page, "Query IMG_0001.HEIC")
        assert status.startswith("Query IMG_0001.HEIC"), status          # alone, not fused
        page.wait_for_function("document.querySelectorAll('#search-results-0 .caption-label').length > 0")
        assert page.locator("#search-results-0 .caption-label").first.inner_text().startswith(label)
    finally:                                      # the page is shared: leave the field empty
        clear = page.locator("#search-more button[aria-label=Clear]")
        if clear.count():
            clear.first.click()
        page.wait_for_function("!document.querySelector('#search-more').innerText.includes('IMG_0001')")


def test_region_and_more_images_in_the_search_tab(page, demo_dirs):
    """The Search tab's region field and multi-upload reach the search (issue 42 item 3): the
    status names the box, then the fused images; a box outside the image is one warning line."""
    (path, label), (other, _) = labelled_folder(demo_dirs[1])[:2]
    page.get_by_role("tab", name="Search").click()
    page.locator("#search-image input[type=file]").set_input_files(str(path))
    page.wait_for_selector("#search-image img")
    region = page.locator("#search-box textarea")
    region.fill("0,0,80,80")
    page.locator("#search-btn").click()
    page.wait_for_function("document.querySelector('#search-status').innerText.includes('[0,0,80,80]')")
    assert page.locator("#search-results-0 .gallery-item img").count() > 0
    region.fill("0,0,5000,80")                                    # outside the 160-px photo
    page.locator("#search-btn").click()
    page.wait_for_function("document.querySelector('#search-status').innerText.includes('box:')")
    assert "outside" in page.locator("#search-status").inner_text()
    region.fill("")
    page.locator("#search-more input[type=file]").set_input_files([str(other)])
    status = _search_until(page, "2 images fused")
    assert "2 images fused" in status and path.name in status, (status, page.locator("#search-more").inner_text())


def test_only_these_labels_restricts_the_results(page, demo_dirs):
    """The Search tab's "Only these labels": a query of one class, another class chosen, every
    result of that class on both indexes; cleared, the query's own class comes back first."""
    (path, label), (_, other) = labelled_folder(demo_dirs[1])[0], labelled_folder(demo_dirs[1])[-1]
    assert label != other
    page.get_by_role("tab", name="Search").click()
    page.locator("#search-image input[type=file]").set_input_files(str(path))
    page.wait_for_selector("#search-image img")
    only = page.locator("#search-only input")
    only.click()
    only.fill(other)
    page.keyboard.press("ArrowDown")
    page.keyboard.press("Enter")
    page.keyboard.press("Escape")
    try:
        status = _search_until(page, f"only {other}")
        assert f"only {other}" in status, status
        for gal in ("#search-results-0", "#search-results-1"):
            captions = page.locator(f"{gal} .caption-label").all_inner_texts()
            assert captions and all(c.startswith(f"{other} · ") for c in captions), captions
    finally:                                      # the page is shared: leave the field empty
        page.locator("#search-only .remove-all").click()
        page.wait_for_function("!document.querySelector('#search-only .token')")
    page.locator("#search-btn").click()
    page.wait_for_function("!document.querySelector('#search-status').innerText.includes('only ')")
    page.wait_for_function("document.querySelectorAll('#search-results-0 .caption-label').length > 0")
    assert page.locator("#search-results-0 .caption-label").first.inner_text().startswith(label)


def test_probes_tab_shows_a_row_per_probe(page, demo_dirs):
    page.get_by_role("tab", name="Probes").click()
    label = labelled_folder(demo_dirs[1])[-1][1]
    pick = page.locator("#probe-pick input")
    pick.click()
    pick.fill(label)
    page.keyboard.press("ArrowDown")
    page.keyboard.press("Enter")
    page.locator("#probe-btn").click()
    page.wait_for_selector("#probe-grid-0 img")
    page.wait_for_selector("#probe-grid-1 img")
    page.wait_for_function("document.querySelector('#probe-table').innerText.includes('shift r_b=1')")
    table = page.locator("#probe-table").inner_text()
    for probe in ("original", "scale x0.5", "scale x0.8", "scale x1.2", "scale x2", "shift r_b=0.5"):
        assert probe in table
    assert f"label {label}" in page.locator("#probe-status").inner_text()
    page.wait_for_function("(e => e && e.complete && e.naturalWidth > 0)(document.querySelector('#probe-grid-0 img'))")
    ok = page.locator("#probe-grid-0 img").evaluate("e => e.complete && e.naturalHeight > 600")
    assert ok    # one row per probe: 7 rows of thumbnails


def test_audit_tab_lists_the_gallery_and_a_click_searches_with_it(page):
    """The Audit tab (issue 42 item 2): the lists with thumbnails, a status with the counts; a
    click on an outlier opens the Search tab with that image picked and its results shown."""
    page.get_by_role("tab", name="Audit").click()
    page.locator("#audit-btn").click()
    page.wait_for_function("document.querySelector('#audit-status').innerText.includes('near-duplicate groups')")
    page.wait_for_function("document.querySelectorAll('#audit-outliers .gallery-item img').length > 0")
    status = page.locator("#audit-status").inner_text()
    assert "40 images" in status and "likely mislabelled" in status
    page.locator("#audit-outliers .gallery-item").first.click()
    page.wait_for_selector("#search-btn", state="visible")
    page.wait_for_function("document.querySelectorAll('#search-results-0 .gallery-item img').length > 0")
    assert "Query" in page.locator("#search-status").inner_text()
