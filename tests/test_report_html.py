"""report.html: every section of report.md on one self-contained page (images embedded, nothing
loaded from outside the file), and report.md's alignment table has its rows."""

from __future__ import annotations

import base64
import html
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from onboarding.cli.main import main
from onboarding.report_html import render


class _Page(HTMLParser):
    """Headings (level, text), every attribute that can load something, the tags seen, and the
    tables (header cells, body rows)."""

    LOADING = {"src", "href", "srcset", "data", "poster", "action", "background", "xlink:href"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.headings: list[tuple[int, str]] = []
        self.refs: list[tuple[str, str, str]] = []
        self.tags: set[str] = set()
        self.tables: list[dict] = []
        self.styles: list[str] = []
        self._text: list[str] | None = None
        self._cell: list[str] | None = None
        self._in_head = False
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        for k, v in attrs:
            if k in self.LOADING or k == "style":
                self.refs.append((tag, k, v or ""))
        if re.fullmatch(r"h[1-6]", tag):
            self._text = []
        elif tag == "table":
            self.tables.append({"head": [], "rows": []})
        elif tag == "thead":
            self._in_head = True
        elif tag == "tr" and not self._in_head:
            self.tables[-1]["rows"].append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "style":
            self._in_style = True

    def handle_endtag(self, tag):
        if re.fullmatch(r"h[1-6]", tag) and self._text is not None:
            self.headings.append((int(tag[1]), "".join(self._text).strip()))
            self._text = None
        elif tag == "thead":
            self._in_head = False
        elif tag in ("td", "th") and self._cell is not None:
            text = "".join(self._cell).strip()
            t = self.tables[-1]
            (t["head"] if tag == "th" else t["rows"][-1]).append(text)
            self._cell = None
        elif tag == "style":
            self._in_style = False

    def handle_data(self, data):
        for buf in (self._text, self._cell):
            if buf is not None:
                buf.append(data)
        if self._in_style:
            self.styles.append(data)


def _page(text: str) -> _Page:
    p = _Page()
    p.feed(text)
    p.close()
    return p


def _plain(md: str) -> str:
    """A Markdown heading's text as the browser shows it."""
    return html.unescape(re.sub(r"\*\*|`", "", md)).strip()


def assert_self_contained(page: _Page) -> None:
    """Nothing the browser would fetch: no script, stylesheet link, frame or object; every
    src a data: URI; every href an anchor in the page; no url()/@import in the styles."""
    assert not page.tags & {"script", "link", "iframe", "frame", "object", "embed", "base",
                            "audio", "video", "source"}, page.tags
    for tag, attr, value in page.refs:
        if attr == "href":
            assert value.startswith("#"), (tag, value)
        elif attr == "style":
            assert "url(" not in value and "@import" not in value, (tag, value)
        else:
            assert value.startswith("data:"), (tag, attr, value[:60])
    css = "".join(page.styles)
    assert "url(" not in css and "@import" not in css


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real CPU run of the built-in hybrid example (one kernel family patched: ~1 minute)."""
    root = tmp_path_factory.mktemp("html")
    out = root / "r"
    assert main(["run", "--out", str(out), "--seq", "16", "--kernels", "rmsnorm"]) == 0
    return out


@pytest.mark.slow
def test_report_html_has_every_section_and_embeds_every_image(run_dir):
    md = (run_dir / "report.md").read_text()
    page_text = (run_dir / "report.html").read_text()
    page = _page(page_text)

    md_headings = [(len(h), _plain(t)) for h, t in
                   re.findall(r"^(#{1,6})\s+(.*?)\s*$", md, flags=re.M)]
    assert [h for h in md_headings if h[0] == 2] and page.headings == md_headings
    for section in ("Model", "Operator graph", "Coverage", "Generated kernels", "Alignment",
                    "Tuning"):
        assert (2, section) in page.headings, page.headings

    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", md)
    assert {"params_by_kind.png", "alignment.png"} <= set(images)
    embedded = [v for tag, attr, v in page.refs if tag == "img" and attr == "src"]
    assert len(embedded) == len(images)
    for src, uri in zip(images, embedded):
        assert uri.startswith("data:image/png;base64,")
        assert base64.b64decode(uri.split(",", 1)[1]) == (run_dir / src).read_bytes()
    assert_self_contained(page)

    # every Markdown table is an HTML table with the same header and as many rows
    md_tables = re.findall(r"^(\|.*\|)\n\|(?:\s*:?-{3,}:?\s*\|)+\n((?:\|.*\|\n?)*)", md, re.M)
    assert len(page.tables) == len(md_tables) >= 5
    for t, (_, body) in zip(page.tables, md_tables):
        assert len(t["rows"]) == len(body.strip().splitlines()), t["head"]
        assert all(len(r) == len(t["head"]) for r in t["rows"]), t["head"]


@pytest.mark.slow
def test_alignment_table_has_a_row_per_block(run_dir):
    md = (run_dir / "report.md").read_text()
    section = md.split("## Alignment", 1)[1].split("\n## ", 1)[0]
    lines = section.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("| # | block |"))
    rows = [x for x in lines[at + 2:] if x.startswith("|")]
    head = re.split(r"(?<!\\)\|", lines[at].strip().strip("|"))
    assert len(head) == len(lines[at + 1].strip("|").split("|"))  # a valid GFM table
    blocks = json.loads((run_dir / "alignment.json").read_text())["blocks"]
    assert len(rows) == len(blocks) > 0 and "`lm_head`" in section
    table = next(t for t in _page((run_dir / "report.html").read_text()).tables
                 if t["head"][:2] == ["#", "block"])
    assert len(table["rows"]) == len(blocks)
    assert "fwd p99 |err|" in table["head"]
    assert all(r[7] == "pass" for r in table["rows"] if r[2] == "norm.rms")


def test_markdown_subset(tmp_path):
    (tmp_path / "a.png").write_bytes(b"\x89PNG\r\n\x1a\nfake")
    md = "\n".join([
        "# T <x>", "", "Para with **bold**, *it*, `a|b <c>` and a break  ", "next line.", "",
        "| h1 | h\\|2 | n |", "|---|---|---|", "| `x|y` | **b** | 1.5e-07 |", "| - | c | 12 |",
        "", "- one", "- two `t`", "", "1. first", "2. second", "",
        "![local](a.png)", "", "![remote](https://example.com/x.png)", "",
        "![gone](missing.png)", "", "[link](https://example.com)", "", "```", "<code> | x",
        "```", "", "## S2"])
    page_text = render(md, tmp_path)
    page = _page(page_text)
    assert page.headings == [(1, "T <x>"), (2, "S2")]
    assert "<strong>bold</strong>" in page_text and "<em>it</em>" in page_text
    assert "<code>a|b &lt;c&gt;</code>" in page_text and "break<br>" in page_text
    (t,) = page.tables
    assert t["head"] == ["h1", "h|2", "n"] and t["rows"] == [["x|y", "b", "1.5e-07"],
                                                            ["-", "c", "12"]]
    assert "<ul><li>one</li><li>two <code>t</code></li></ul>" in page_text
    assert "<ol><li>first</li><li>second</li></ol>" in page_text
    assert "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nfake").decode() \
        in page_text
    assert "example.com/x.png" not in page_text and 'src="http' not in page_text
    assert "[image not embedded: remote]" in page_text
    assert "[image not embedded: gone]" in page_text
    assert "<pre><code>&lt;code&gt; | x</code></pre>" in page_text
    refs = [v for _, a, v in page.refs if a == "href"]
    assert sorted(refs) == ["#s2", "https://example.com"]  # the contents line, a plain link


@pytest.mark.slow
def test_long_alignment_table_keeps_failing_and_worst_per_kind_rows(parse_model):
    """Above the row limit the table lists the failing blocks and each kind's worst block, so
    an all-pass run still has a row per kind (it used to print a header and no rows)."""
    from onboarding.align.core import align, build_pair
    from onboarding.graph.parse import example_inputs, load_stage
    from onboarding.load.model import load_model

    graph = parse_model("hf:qwen3_moe")
    info = load_stage(load_model("hf:qwen3_moe", trust_remote_code=True))
    model = info.loaded.build(info.proxy_config, seed=0)
    reference, candidate = build_pair(model, reference_dtype="fp64", candidate_dtype="fp32")
    inputs, kwargs = example_inputs(model, info.proxy_config, 1, 16, 0)
    result = align(reference, candidate, graph, inputs, kwargs)
    assert result.passed
    md = result.to_markdown(only_failing=True)
    rows = [x for x in md.splitlines() if x.startswith("| ") and not x.startswith("| # ")]
    kinds = {b.kind for b in result.blocks}
    assert len(rows) == len(kinds) > 1 and f"{len(result.blocks)} blocks, 0 failing" in md
    page = _page(render("## Alignment\n\n" + md, Path(".")))
    assert len(page.tables[0]["rows"]) == len(kinds)
