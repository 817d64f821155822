"""The release files agree with the package: its license, its version, a changelog to add to."""

import tomllib

import yaml

from support import ROOT

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_license_file_is_the_declared_license():
    assert PROJECT["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_citation_names_this_version_and_the_study():
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert citation["version"] == PROJECT["version"] and citation["license"] == PROJECT["license"]
    (study,) = citation["references"]
    assert study["title"].startswith("Dense Supervision Is Not Enough")
    assert study["title"] in (ROOT / "README.md").read_text()


def test_changelog_has_an_unreleased_section_first():
    headings = [
        line for line in (ROOT / "CHANGELOG.md").read_text().splitlines() if line.startswith("## ")
    ]
    assert headings[0] == "## Unreleased" and f"## {PROJECT['version']}" in headings
