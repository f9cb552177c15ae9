"""Small HTML pieces of the inspector: numbers as the page shows them, the full text of a response (its <think> and
<answer> parts set apart), status messages, and the page's CSS. Every piece of run data is HTML-escaped."""

from __future__ import annotations

import html
import math
import re

from mmpg.runs import ResponseRecord

CSS = """
.mmpg-query { font-size: 1.1em; font-weight: 600; margin-bottom: 4px; }
.mmpg-facts { margin: 2px 0; }
.mmpg-video { color: var(--body-text-color-subdued); margin: 2px 0; }
.mmpg-note { background: #fff4d6; color: #6b4e00; border-radius: 4px; padding: 6px 10px; margin: 6px 0; }
.mmpg-error { background: #fde2e1; color: #7a1c16; border-radius: 4px; padding: 6px 10px; margin: 6px 0; }
.mmpg-info { color: var(--body-text-color-subdued); margin: 4px 0; }
.mmpg-part { border-radius: 6px; padding: 8px 12px; margin: 6px 0; }
.mmpg-part pre { white-space: pre-wrap; word-break: break-word; margin: 0; font-family: var(--font-mono); }
.mmpg-part .tag { font-size: 0.8em; font-weight: 700; text-transform: uppercase; letter-spacing: 0.05em;
                  margin-bottom: 4px; opacity: 0.75; }
.mmpg-think { background: #eef2f7; color: #27323f; border-left: 4px solid #8aa1bd; }
.mmpg-answer { background: #e6f4ea; color: #17351f; border-left: 4px solid #2e9d57; }
.mmpg-text { background: #f6f6f6; color: #333; border-left: 4px solid #bbb; }
.mmpg-tool { background: #fdf3e1; color: #4a3410; border-left: 4px solid #d89b2b; }
.mmpg-response-facts { color: var(--body-text-color-subdued); margin-bottom: 4px; }
#timeline, #eval-timeline { min-height: 60px; }
.mmpg-strip { display: flex; gap: 6px; overflow-x: auto; padding: 4px 0 8px; }
.mmpg-strip figure { margin: 0; flex: 0 0 auto; text-align: center; }
.mmpg-strip img { height: 110px; border-radius: 4px; transition: transform 0.15s; transform-origin: top center;
                  position: relative; }
.mmpg-strip img:hover { transform: scale(2.2); z-index: 20; box-shadow: 0 4px 16px rgba(0, 0, 0, 0.35); }
.mmpg-strip figcaption { font-size: 0.8em; color: var(--body-text-color-subdued); }
.mmpg-summary-title { font-weight: 600; margin: 2px 0 6px; }
.mmpg-cards { display: flex; flex-wrap: wrap; gap: 10px; }
.mmpg-card { border: 1px solid var(--border-color-primary); border-radius: 6px; padding: 6px 10px; }
.mmpg-card-name { font-size: 0.85em; color: var(--body-text-color-subdued); text-transform: uppercase;
                  letter-spacing: 0.04em; }
.mmpg-card-now { font-size: 1.5em; font-weight: 700; }
.mmpg-sub { font-size: 0.8em; font-weight: 400; color: var(--body-text-color-subdued); text-transform: none; }
.mmpg-up { color: #1a7f43; font-weight: 600; }
.mmpg-down { color: #c0392b; font-weight: 600; }
.mmpg-flat { color: var(--body-text-color-subdued); }
.mmpg-evals { border: none !important; margin: 0; }
.mmpg-plan { max-width: 560px; }
.mmpg-evals td, .mmpg-evals th { padding: 1px 8px !important; text-align: right; border: none !important; }
.mmpg-caption { font-size: 0.85em; color: var(--body-text-color-subdued); margin: 0 4px -6px; }
.mmpg-plots img { max-height: 300px; margin: 4px; border: 1px solid #ddd; border-radius: 4px; }
"""

_TAGS = {"think": "think", "answer": "answer", "text": "outside the tags"}
_TAG = re.compile(r"<(think|answer)>(.*?)(?:</\1>|$)", re.S)


def fmt(x, digits: int = 3) -> str:
    """A number in running text: fixed digits, '—' for a missing or non-finite value."""
    return "—" if x is None or not math.isfinite(float(x)) else f"{float(x):.{digits}f}"


def response_html(index: int, r: ResponseRecord, fate=None) -> str:
    """A response with its facts on top (what went wrong first, when something did: `fate`, its
    `mmpg_app.answers.AnswerFate`) and each part (<think>, <answer>, other text) in its own box."""
    span = f"{fmt(r.parsed_span[0], 2)} – {fmt(r.parsed_span[1], 2)} s" if r.parsed_span else "did not parse"
    failure = (f'<div class="mmpg-error mmpg-fate"><b>{html.escape(fate.label)}</b>: {html.escape(fate.why)}</div>'
               if fate is not None and fate.failed else "")
    rewards = ", ".join(f"{k} {fmt(v)}" for k, v in r.rewards.items())
    zooms = sum("zoom" in t for t in r.turns) if r.turns else 0
    facts = (f"<b>Response #{index}</b> · parsed span {span} · {rewards} · advantage {fmt(r.advantage)} · "
             f"{r.length} tokens" + (f" · {zooms} zoom(s)" if r.turns else "") + f" · finish: "
             f"{html.escape(r.finish_reason)}" + (" (hit max_new_tokens: truncated)" if r.finish_reason == "length"
                                                  else ""))
    body = turns_html(r.turns) if r.turns else text_parts_html(r.text)
    return failure + f'<div class="mmpg-response-facts">{facts}</div>' + body


def turns_html(turns: list[dict]) -> str:
    """A multi-turn response (the zoom tool): each model turn's parts, and between them the tool's turn, the
    window it showed (and its frame count) or its error."""
    out = []
    for t in turns:
        if "model" in t:
            out.append(text_parts_html(t["model"]))
        elif "zoom" in t:
            a, b = t["zoom"]
            out.append(f'<div class="mmpg-part mmpg-tool"><div class="tag">zoom</div><pre>{fmt(a, 2)} – {fmt(b, 2)} s'
                       f", {int(t.get('frames', 0))} frames</pre></div>")
        else:
            out.append(f'<div class="mmpg-part mmpg-tool mmpg-error"><div class="tag">tool error</div>'
                       f"<pre>{html.escape(str(t.get('error')))}</pre></div>")
    return "".join(out)


def text_parts_html(text: str) -> str:
    if not text:
        return '<div class="mmpg-info">(empty response)</div>'
    return "".join(f'<div class="mmpg-part mmpg-{kind}"><div class="tag">{_TAGS[kind]}</div>'
                   f"<pre>{html.escape(part)}</pre></div>" for kind, part in split_response(text))


def split_response(text: str) -> list[tuple[str, str]]:
    """[(kind, text)] with kind 'think', 'answer' or 'text', in order. A tag left open (a truncated response) runs
    to the end of the text."""
    parts, pos = [], 0
    for m in _TAG.finditer(text):
        if m.start() > pos and text[pos:m.start()].strip():
            parts.append(("text", text[pos:m.start()]))
        parts.append((m.group(1), m.group(2)))
        pos = m.end()
    if text[pos:].strip() or not parts:
        parts.append(("text", text[pos:]))
    return parts


def message_html(text: str, kind: str = "info") -> str:
    """A status line: kind 'info', 'note' (something is missing) or 'error'."""
    if not text:
        return ""
    return f'<div class="mmpg-{kind}">{html.escape(text)}</div>'
