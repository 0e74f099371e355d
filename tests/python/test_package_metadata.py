"""The installed distribution's metadata (what the built wheel's METADATA carries, pyproject.toml's
[project] table): the project URLs a package index shows, each a real https URL under the canonical
repository, and the version CMakeLists.txt writes."""
import re
from importlib import metadata
from pathlib import Path

import kspec

ROOT = Path(__file__).resolve().parents[2]
CANONICAL = "https://github.com/kspec-dev/kspec"


def test_wheel_metadata_carries_the_project_urls():
    urls = dict(u.split(", ", 1) for u in metadata.metadata("kspec").get_all("Project-URL") or [])
    assert set(urls) >= {"Homepage", "Repository", "Documentation", "Changelog", "Issues"}, urls
    for label, url in urls.items():
        assert url == CANONICAL or url.startswith(CANONICAL + "/"), (label, url)
    assert urls["Repository"] == CANONICAL
    # the files the URLs name exist in the repository
    for label in ("Documentation", "Changelog"):
        path = urls[label].split("/blob/main/", 1)[1]
        assert (ROOT / path).is_file(), (label, path)


def test_wheel_metadata_version_is_cmakes():
    cmake = (ROOT / "CMakeLists.txt").read_text()
    version = re.search(r"project\(kspec VERSION ([0-9][0-9a-z.]*)", cmake).group(1)
    assert metadata.version("kspec") == version == kspec.__version__
