"""``report.html``: the run report as one self-contained page, next to ``report.md``.

Standard library only. Converts the Markdown subset the report uses (ATX headings, pipe tables,
``-``/``1.`` lists, paragraphs with hard breaks, fenced code, inline code, bold, italics, links
and images) and embeds every local image as a ``data:`` URI. The page loads nothing from
outside itself: styles are inline, there is no script, and an image that is remote or missing
is shown as its alt text.
"""

from __future__ import annotations

import base64
import html
import mimetypes
import re
from pathlib import Path

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;
 color:#1d232a;background:#fff;margin:0}
main{max-width:1240px;margin:0 auto;padding:18px 28px 60px}
h1{font-size:26px;margin:.4em 0 .3em}
h2{font-size:20px;margin:1.6em 0 .5em;padding-bottom:.2em;border-bottom:2px solid #d6dde5}
h3{font-size:16px;margin:1.3em 0 .4em}
p,li{max-width:110ch;overflow-wrap:anywhere}
code{font:12.5px/1.3 ui-monospace,"DejaVu Sans Mono",Menlo,Consolas,monospace;
 background:#f1f3f6;padding:1px 4px;border-radius:3px}
pre{background:#f1f3f6;padding:10px;overflow-x:auto}
pre code{padding:0;background:none}
.table{overflow-x:auto;margin:.6em 0 1em}
table{border-collapse:collapse;font-size:13px}
th,td{border:1px solid #d6dde5;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#e9eef4;position:sticky;top:0}
tr:nth-child(even) td{background:#f7f9fb}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
figure{margin:.8em 0}
img{max-width:100%;height:auto;border:1px solid #e3e7ec}
figcaption{color:#5a6570;font-size:12px}
nav.toc{background:#f5f7fa;border:1px solid #e3e7ec;padding:6px 14px;margin:.6em 0 1em}
nav.toc a{margin-right:14px;white-space:nowrap}
details summary{cursor:pointer;color:#2c5d8f;margin:.2em 0}
.missing{color:#a33;font-style:italic}
"""

_NUM = re.compile(r"^[-+]?[\d,]*\.?\d+(e[-+]?\d+)?\s*[%x]?\s*[KMBT]?$|^[—-]$", re.I)
_TABLE_SEP = re.compile(r"^\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_ITEM = re.compile(r"^(\s*)([-*+]|\d+[.)])\s+(.*)$")
_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)(?:\s+\"([^\"]*)\")?\)")
_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")
LIST_VISIBLE = 4  # a list longer than LIST_COLLAPSE shows this many items, the rest folded
LIST_COLLAPSE = 12


def _slug(text: str, seen: dict[str, int]) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", re.sub(r"<[^>]+>", "", text).lower()).strip("-") or "s"
    n = seen.get(s, 0)
    seen[s] = n + 1
    return s if not n else f"{s}-{n}"


def _data_uri(src: str, base: Path) -> str | None:
    """A local image as a data: URI; None for a remote, absolute-URL or missing file."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", src, re.I) or src.startswith("//"):
        return None
    path = (base / src)
    if not path.is_file():
        return None
    mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def _image(alt: str, src: str, base: Path) -> str:
    uri = _data_uri(src, base)
    if uri is None:
        return f'<span class="missing">[image not embedded: {html.escape(alt or src)}]</span>'
    return f'<img src="{uri}" alt="{html.escape(alt, quote=True)}">'


def _emphasis(text: str) -> str:
    """Bold and italics on already-escaped text (no code spans in it)."""
    text = re.sub(r"\*\*(?=\S)(.+?)(?<=\S)\*\*", r"<strong>\1</strong>", text)
    text = re.sub(r"__(?=\S)(.+?)(?<=\S)__", r"<strong>\1</strong>", text)
    return re.sub(r"(?<![\w*])\*(?=[^\s*])(.+?)(?<=[^\s*])\*(?![\w*])", r"<em>\1</em>", text)


def inline(text: str, base: Path) -> str:
    """One line or cell of Markdown to HTML: code spans first (taken literally), then images,
    links, bold and italics; everything else escaped."""
    out = []
    for i, part in enumerate(re.split(r"(`+)(.+?)\1", text)):
        kind = i % 3
        if kind == 1:  # the backtick run of a code span
            continue
        if kind == 2:
            out.append(f"<code>{html.escape(part.strip() if part.strip() else part)}</code>")
            continue
        part = part.replace("\\|", "|")
        pieces, pos = [], 0
        for m in re.finditer(f"{_IMAGE.pattern}|{_LINK.pattern}", part):
            pieces.append(_emphasis(html.escape(part[pos:m.start()], quote=False)))
            if m.group(0).startswith("!"):
                pieces.append(_image(m.group(1), m.group(2), base))
            else:
                label, href = m.group(4), m.group(5)
                pieces.append(f'<a href="{html.escape(href, quote=True)}">'
                              f'{_emphasis(html.escape(label, quote=False))}</a>')
            pos = m.end()
        pieces.append(_emphasis(html.escape(part[pos:], quote=False)))
        out.append("".join(pieces))
    return "".join(out)


def _cells(line: str) -> list[str]:
    """A table row's cells: split on pipes that are neither escaped nor inside a code span."""
    line = line.strip()
    if line.startswith("|"):
        line = line[1:]
    if line.endswith("|") and not line.endswith("\\|"):
        line = line[:-1]
    cells, cur, in_code, i = [], [], "", 0
    while i < len(line):
        c = line[i]
        if c == "\\" and i + 1 < len(line) and line[i + 1] == "|":
            cur.append("\\|")
            i += 2
            continue
        if c == "`":
            j = i
            while j < len(line) and line[j] == "`":
                j += 1
            run = line[i:j]
            in_code = "" if in_code == run else (in_code or run)
            cur.append(run)
            i = j
            continue
        if c == "|" and not in_code:
            cells.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
        i += 1
    cells.append("".join(cur).strip())
    return cells


def _table(lines: list[str], base: Path) -> str:
    head = _cells(lines[0])
    aligns = []
    for c in _cells(lines[1]):
        c = c.strip()
        aligns.append("right" if c.endswith(":") and not c.startswith(":") else
                      "center" if c.startswith(":") and c.endswith(":") else "")
    out = ['<div class="table"><table>', "<thead><tr>" +
           "".join(f"<th>{inline(h, base)}</th>" for h in head) + "</tr></thead>", "<tbody>"]
    for line in lines[2:]:
        cells = _cells(line)
        cells = (cells + [""] * len(head))[:max(len(head), 1)]
        tds = []
        for k, c in enumerate(cells):
            a = aligns[k] if k < len(aligns) else ""
            cls = ' class="num"' if _NUM.match(c) else ""
            style = f' style="text-align:{a}"' if a else ""
            tds.append(f"<td{cls}{style}>{inline(c, base)}</td>")
        out.append("<tr>" + "".join(tds) + "</tr>")
    out.append("</tbody></table></div>")
    return "\n".join(out)


def _list(items: list[tuple[bool, str]], base: Path) -> str:
    ordered = items[0][0]
    tag = "ol" if ordered else "ul"
    lis = [f"<li>{inline(text, base)}</li>" for _, text in items]
    if len(lis) <= LIST_COLLAPSE:
        return f"<{tag}>" + "".join(lis) + f"</{tag}>"
    return (f"<{tag}>" + "".join(lis[:LIST_VISIBLE]) + f"</{tag}>"
            f"<details><summary>{len(lis) - LIST_VISIBLE} more</summary>"
            f'<{tag} start="{LIST_VISIBLE + 1}">' + "".join(lis[LIST_VISIBLE:]) +
            f"</{tag}></details>")


def markdown_to_html(md: str, base: Path) -> tuple[str, list[tuple[int, str, str]]]:
    """The body HTML of ``md`` and its headings (level, id, text); images resolve from ``base``."""
    lines = md.splitlines()
    out: list[str] = []
    headings: list[tuple[int, str, str]] = []
    seen: dict[str, int] = {}
    para: list[str] = []
    items: list[tuple[bool, str]] = []

    def flush() -> None:
        if para:
            text = "".join(inline(p.rstrip(), base) + ("<br>\n" if p.endswith("  ") else "\n")
                           for p in para).rstrip()
            alone = _IMAGE.fullmatch(" ".join(para).strip())
            if alone:  # an image on its own: a figure with its caption
                out.append(f"<figure>{_image(alone.group(1), alone.group(2), base)}"
                           f"<figcaption>{html.escape(alone.group(1))}</figcaption></figure>")
            else:
                out.append(f"<p>{text.removesuffix('<br>')}</p>")
            para.clear()
        if items:
            out.append(_list(items, base))
            items.clear()

    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            flush()
            i += 1
            continue
        if line.lstrip().startswith("```"):
            flush()
            fence, body = line.lstrip()[:3], []
            i += 1
            while i < len(lines) and not lines[i].lstrip().startswith(fence):
                body.append(lines[i])
                i += 1
            out.append(f"<pre><code>{html.escape(chr(10).join(body))}</code></pre>")
            i += 1
            continue
        h = _HEADING.match(line)
        if h:
            flush()
            level, text = len(h.group(1)), inline(h.group(2), base)
            hid = _slug(text, seen)
            headings.append((level, hid, text))
            out.append(f'<h{level} id="{hid}">{text}</h{level}>')
            i += 1
            continue
        if line.lstrip().startswith("|") and i + 1 < len(lines) and \
                _TABLE_SEP.match(lines[i + 1].strip()):
            flush()
            j = i + 2
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                j += 1
            out.append(_table(lines[i:j], base))
            i = j
            continue
        m = _ITEM.match(line)
        if m and not para:
            ordered = m.group(2)[0].isdigit()
            if items and items[0][0] != ordered:
                flush()
            items.append((ordered, m.group(3)))
            i += 1
            continue
        if items and line[:1].isspace():  # a list item's continuation line
            o, t = items[-1]
            items[-1] = (o, t + " " + line.strip())
            i += 1
            continue
        if items:
            flush()
        para.append(line)
        i += 1
    flush()
    return "\n".join(out), headings


def render(md: str, base: Path) -> str:
    """A whole self-contained page: the title from the first level-1 heading, a contents line
    linking every level-2 section, the body."""
    body, headings = markdown_to_html(md, base)
    title = next((re.sub(r"<[^>]+>", "", t) for lv, _, t in headings if lv == 1), "report")
    toc = " ".join(f'<a href="#{hid}">{t}</a>' for lv, hid, t in headings if lv == 2)
    if toc:
        first_h2 = body.find("<h2")
        nav = f'<nav class="toc"><strong>Sections:</strong> {toc}</nav>\n'
        body = body[:first_h2] + nav + body[first_h2:] if first_h2 >= 0 else nav + body
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>{title}</title>\n<style>{_CSS}</style></head>\n"
            f"<body><main>\n{body}\n</main></body></html>\n")


def write_html(md_path: Path) -> Path:
    """Write ``report.html`` beside ``md_path`` (images resolved from its folder)."""
    md_path = Path(md_path)
    out = md_path.with_suffix(".html")
    out.write_text(render(md_path.read_text(), md_path.parent), encoding="utf-8")
    return out
