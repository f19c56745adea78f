"""The one-page HTML view of a graph dump (written by graph_dump.GraphDumper.finish).

Self-contained: inline CSS and JS, no network. The op-count table is plain
HTML (readable without JS); the stage view (diff regions and the highlighted
code) is drawn by a small script from JSON embedded in the page, so a large
graph costs one stage's DOM at a time, not all of them.
"""

from __future__ import annotations

import html
import json
import time

import torch

__all__ = ["render_index"]


def render_index(dumper) -> str:
    recs = dumper.records
    data = [_stage_data(r) for r in recs]
    # "<" escaped so no string in the data can close the <script> element.
    blob = json.dumps(data).replace("<", "\\u003c")
    meta = [f"torch {torch.__version__}", time.strftime("%Y-%m-%d %H:%M:%S")]
    if dumper.rank is not None:
        meta.insert(0, f"rank {dumper.rank}")
    meta.append(str(dumper.dir))
    return _PAGE.format(
        title=html.escape(dumper.title),
        meta=" · ".join(html.escape(m) for m in meta),
        nav="\n".join(_nav_item(r) for r in recs),
        table=_op_table(recs),
        data=blob,
        css=_CSS,
        js=_JS,
    )


def _stage_data(r) -> dict:
    d = r.diff
    marks: dict[int, str] = {}
    diff = None
    if d is not None:
        diff = {
            "ops": {k: list(v) for k, v in d.ops.items()},
            "unchanged": d.unchanged,
            "added": len(d.added),
            "changed": len(d.changed),
            "removed": len(d.removed),
            "retraced": d.retraced,
            "regions": [],
        }
        if not d.retraced:
            for n in d.added:
                if n in r.line_of:
                    marks[r.line_of[n]] = "add"
            for n in d.changed:
                if n in r.line_of:
                    marks[r.line_of[n]] = "chg"
            for reg in d.regions:
                diff["regions"].append(
                    {
                        "summary": reg.summary,
                        "removed": [d.removed_lines.get(n, n) for n in reg.removed],
                        # Added / changed ones point at their line in the code view.
                        "changed": [[n, r.line_of.get(n, -1)] for n in reg.changed],
                        "added": [[n, r.line_of.get(n, -1)] for n in reg.added],
                    }
                )
    return {
        "i": r.index,
        "stage": r.stage,
        "note": r.note,
        "file": r.file_stem + ".py",
        "nodes": r.n_nodes,
        "code": (r.code or "").splitlines(),
        "marks": marks,
        "diff": diff,
    }


def _nav_item(r) -> str:
    d = r.diff
    if r.index == 0:
        chips = '<span class="chip">first</span>'
    elif d is None:
        chips = '<span class="chip">no diff</span>'
    elif d.retraced:
        chips = '<span class="chip">retraced</span>'
    elif not (d.added or d.changed or d.removed):
        chips = '<span class="chip">no change</span>'
    else:
        chips = "".join(
            f'<span class="chip {cls}">{sign}{n}</span>'
            for cls, sign, n in (("add", "+", len(d.added)), ("chg", "~", len(d.changed)), ("rem", "\u2212", len(d.removed)))
            if n
        )
    note = f'<div class="note">{html.escape(r.note)}</div>' if r.note else ""
    return (
        f'<a class="stage" href="#s{r.index}" data-i="{r.index}">'
        f'<span class="nn">{r.index:02d}</span> <span class="sname">{html.escape(r.stage)}</span>'
        f'<div class="chips">{chips}</div>{note}</a>'
    )


def _op_table(recs) -> str:
    ops = sorted(set().union(*(r.ops for r in recs))) if recs else []
    head = "".join(
        f'<th class="col" data-i="{r.index}"><a href="#s{r.index}">{r.index:02d}<br>'
        f"<span>{html.escape(r.stage)}</span></a></th>"
        for r in recs
    )
    rows = []
    for op in ops:
        cells, last = [], None
        for r in recs:
            n = r.ops.get(op, 0)
            cls = "zero" if n == 0 else ""
            delta = ""
            if last is not None and n != last:
                cls = "up" if n > last else "down"
                delta = f'<sup>{n - last:+d}</sup>'
            shown = n if n or delta else "\u00b7"  # a dot for an unchanged zero keeps the table quiet
            cells.append(f'<td class="{cls}">{shown}{delta}</td>')
            last = n
        rows.append(f'<tr><th class="op">{html.escape(op)}</th>{"".join(cells)}</tr>')
    sizes = "".join(f"<td>{r.n_nodes}</td>" for r in recs)
    rows.append(f'<tr class="total"><th class="op">graph nodes</th>{sizes}</tr>')
    return f'<table class="ops"><thead><tr><th class="op">op</th>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


_CSS = """
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1d2330; background: #f6f7f9; }
header { padding: 10px 18px; background: #1f2a44; color: #fff; }
header h1 { margin: 0; font-size: 18px; font-weight: 600; }
header .meta { font-size: 12px; opacity: .75; margin-top: 2px; }
#layout { display: flex; align-items: flex-start; }
nav { width: 250px; flex: none; position: sticky; top: 0; max-height: 100vh; overflow: auto; padding: 10px; }
nav h2, main h2 { font-size: 13px; text-transform: uppercase; letter-spacing: .05em; color: #5b6475; margin: 6px 0 8px; }
a.stage { display: block; padding: 6px 8px; margin-bottom: 4px; border-radius: 6px; color: inherit; text-decoration: none; background: #fff; border: 1px solid #e1e4ea; }
a.stage:hover { border-color: #9aa7c2; }
a.stage.active { border-color: #3b6fd8; box-shadow: 0 0 0 2px #3b6fd833; }
.nn { font: 12px ui-monospace, Menlo, Consolas, monospace; color: #7a8394; }
.sname { font-weight: 600; word-break: break-word; }
.note { font-size: 12px; color: #5b6475; }
.chips { margin-top: 2px; }
.chip { display: inline-block; font: 11px ui-monospace, Menlo, Consolas, monospace; padding: 0 5px; margin-right: 3px; border-radius: 8px; background: #e8ebf0; color: #5b6475; }
.chip.add { background: #d3f5d8; color: #17692a; }
.chip.chg { background: #fbefc4; color: #7a5a00; }
.chip.rem { background: #fbd9d9; color: #9b1c1c; }
main { flex: 1; min-width: 0; padding: 10px 18px 40px 8px; }
section { background: #fff; border: 1px solid #e1e4ea; border-radius: 8px; padding: 10px 14px; margin-bottom: 14px; }
.tablewrap { overflow: auto; max-height: 60vh; }
table.ops { border-collapse: collapse; font: 12px ui-monospace, Menlo, Consolas, monospace; }
table.ops th, table.ops td { border: 1px solid #e6e8ee; padding: 2px 8px; text-align: right; white-space: nowrap; }
table.ops thead th { position: sticky; top: 0; background: #f0f2f6; text-align: center; vertical-align: bottom; z-index: 1; }
table.ops thead th a { color: inherit; text-decoration: none; }
table.ops thead th span { font-family: system-ui, sans-serif; font-weight: 600; }
table.ops th.op { text-align: left; position: sticky; left: 0; background: #fafbfc; z-index: 2; }
table.ops th.col.active { background: #dfe8fb; }
table.ops td.zero { color: #b7bcc6; }
table.ops td.up { background: #d3f5d8; color: #17692a; font-weight: 700; }
table.ops td.down { background: #fbd9d9; color: #9b1c1c; font-weight: 700; }
table.ops sup { font-weight: 400; margin-left: 2px; }
table.ops tr.total td, table.ops tr.total th { border-top: 2px solid #c9ced8; color: #5b6475; }
.summary { margin: 4px 0 8px; }
.opdelta { font: 12px ui-monospace, Menlo, Consolas, monospace; margin: 4px 0 8px; }
.opdelta .up { color: #17692a; } .opdelta .down { color: #9b1c1c; }
.region { border-left: 3px solid #9aa7c2; margin: 6px 0; padding: 2px 0 2px 8px; }
.region h3 { font: 600 12px ui-monospace, Menlo, Consolas, monospace; margin: 0 0 2px; color: #38425a; }
.region .rk { font-size: 11px; margin-top: 4px; }
.region summary { font-size: 12px; cursor: pointer; margin: 3px 0; }
.rl { font: 12px/1.5 ui-monospace, Menlo, Consolas, monospace; white-space: pre; overflow-x: auto; }
.rl.rem { color: #9b1c1c; background: #fdf0f0; }
.rl.add { color: #17692a; background: #eefbf0; cursor: pointer; }
.rl.chg { color: #7a5a00; background: #fdf8e6; cursor: pointer; }
.controls { font-size: 13px; margin: 4px 0 6px; color: #5b6475; }
pre.code { margin: 0; font: 12px/1.45 ui-monospace, Menlo, Consolas, monospace; overflow: auto; max-height: 80vh; background: #fbfcfd; border: 1px solid #eceef2; border-radius: 6px; }
pre.code div { white-space: pre; padding-right: 12px; }
pre.code .no { display: inline-block; width: 4.5em; padding-right: 10px; text-align: right; color: #a3aab7; user-select: none; }
pre.code .add { background: #d9f7de; }
pre.code .chg { background: #fcf1cc; }
pre.code .gap { color: #8a93a3; background: #f0f2f6; font-style: italic; }
pre.code .flash { outline: 2px solid #3b6fd8; }
.muted { color: #7a8394; }
"""

_JS = r"""
const DATA = JSON.parse(document.getElementById('dump-data').textContent);
const esc = s => String(s).replace(/[&<>"]/g, c => ({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'}[c]));
const CONTEXT = 3, MAX_FOLDED = 200;
// A code line as the diff lists it: no indentation, no trailing `;  x = None` frees.
const bare = s => s.replace(/;\s+(\w+\s*=\s*)+None\s*$/, '').trim();
let current = -1;

function show(i) {
  if (!DATA.length) { document.getElementById('stage').textContent = 'No stage was recorded.'; return; }
  if (!(i in DATA)) i = 0;
  current = i;
  document.querySelectorAll('a.stage').forEach(a => a.classList.toggle('active', +a.dataset.i === i));
  document.querySelectorAll('th.col').forEach(th => th.classList.toggle('active', +th.dataset.i === i));
  const st = DATA[i], d = st.diff;
  let h = `<h2>Stage ${String(i).padStart(2, '0')} · ${esc(st.stage)}</h2>`;
  if (st.note) h += `<div class="note">${esc(st.note)}</div>`;
  h += `<div class="muted">${st.nodes} nodes · file ${esc(st.file)}</div>`;
  if (i === 0) h += `<p class="summary">First stage: nothing to compare against.</p>`;
  else if (!d) h += `<p class="summary">No diff (it failed; see the log).</p>`;
  else {
    const prev = DATA[i - 1];
    h += `<p class="summary">Against ${String(i - 1).padStart(2, '0')} ${esc(prev.stage)}: `
       + (d.added + d.changed + d.removed === 0 ? `no node changed (${d.unchanged} nodes)</p>` :
          `<span class="chip add">+${d.added} added</span><span class="chip chg">~${d.changed} changed</span>`
        + `<span class="chip rem">\u2212${d.removed} removed</span> ${d.unchanged} unchanged</p>`);
    const ops = Object.entries(d.ops);
    if (ops.length) h += '<div class="opdelta">' + ops.map(([op, [a, b]]) =>
        `<div class="${b > a ? 'up' : 'down'}">${esc(op)}: ${a} \u2192 ${b} (${b > a ? '+' : ''}${b - a})</div>`).join('') + '</div>';
    else h += '<div class="opdelta muted">op counts unchanged</div>';
    if (d.retraced) h += '<p class="muted">The graph was traced anew (names and ops differ throughout): compare the op counts.</p>';
    // Alike regions (the same rewrite in every layer) fold under their first.
    const groups = new Map();
    d.regions.forEach((r, k) => {
      if (!groups.has(r.summary)) groups.set(r.summary, []);
      groups.get(r.summary).push([k, r]);
    });
    for (const [summary, rs] of groups) {
      h += `<div class="region"><h3>${rs.length} × ${esc(summary)}</h3>` + regionLines(st, rs[0][0], rs[0][1]);
      if (rs.length > 1) {
        h += `<details><summary class="muted">the other ${rs.length - 1} alike</summary>`;
        rs.slice(1, MAX_FOLDED + 1).forEach(([k, r]) => h += regionLines(st, k, r));
        if (rs.length - 1 > MAX_FOLDED) h += `<div class="muted">… ${rs.length - 1 - MAX_FOLDED} more: see the .diff.txt file</div>`;
        h += '</details>';
      }
      h += '</div>';
    }
  }
  const marked = Object.keys(st.marks).length;
  const compact = marked > 0 && st.code.length > 400;
  h += `<div class="controls"><label><input type="checkbox" id="only" ${compact ? 'checked' : ''}> only changed lines (\u00b1${CONTEXT})</label>`
     + ` · <span class="chip add">added</span><span class="chip chg">changed</span></div><pre class="code" id="code"></pre>`;
  document.getElementById('stage').innerHTML = h;
  document.getElementById('only').onchange = e => drawCode(st, e.target.checked);
  document.querySelectorAll('.rl[data-l]').forEach(el => el.onclick = () => jump(st, +el.dataset.l));
  drawCode(st, compact);
}

function regionLines(st, k, r) {
  let h = `<div class="rk muted">region ${k + 1}</div>`;
  r.removed.forEach(t => h += `<div class="rl rem">- ${esc(t)}</div>`);
  r.changed.forEach(([n, l]) => h += `<div class="rl chg" data-l="${l}">~ ${esc(l >= 0 ? bare(st.code[l]) : n)}</div>`);
  r.added.forEach(([n, l]) => h += `<div class="rl add" data-l="${l}">+ ${esc(l >= 0 ? bare(st.code[l]) : n)}</div>`);
  return h;
}

function drawCode(st, only) {
  const lines = st.code, marks = st.marks, keep = new Uint8Array(lines.length);
  if (only) {
    for (const k of Object.keys(marks)) for (let j = Math.max(0, +k - CONTEXT); j <= Math.min(lines.length - 1, +k + CONTEXT); j++) keep[j] = 1;
  } else keep.fill(1);
  const out = [];
  let skipped = 0;
  for (let k = 0; k < lines.length; k++) {
    if (!keep[k]) { skipped++; continue; }
    if (skipped) { out.push(`<div class="gap">      \u22ef ${skipped} unchanged lines \u22ef</div>`); skipped = 0; }
    const cls = marks[k] || '';
    out.push(`<div id="L${k}" class="${cls}"><span class="no">${k + 1}</span>${esc(lines[k])}</div>`);
  }
  if (skipped) out.push(`<div class="gap">      \u22ef ${skipped} unchanged lines \u22ef</div>`);
  document.getElementById('code').innerHTML = out.join('');
}

function jump(st, l) {
  if (l < 0) return;
  let el = document.getElementById('L' + l);
  if (!el) { document.getElementById('only').checked = false; drawCode(st, false); el = document.getElementById('L' + l); }
  el.scrollIntoView({block: 'center'});
  el.classList.add('flash');
  setTimeout(() => el.classList.remove('flash'), 1200);
}

function fromHash() {
  const m = /^#s(\d+)$/.exec(location.hash);
  if (m) return +m[1];
  // Default: the first stage a pass actually changed.
  const k = DATA.findIndex(s => s.diff && !s.diff.retraced && (s.diff.added + s.diff.changed + s.diff.removed) > 0);
  return k < 0 ? 0 : k;
}
window.addEventListener('hashchange', () => show(fromHash()));
show(fromHash());
"""

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>graph dump: {title}</title>
<style>{css}</style></head>
<body>
<header><h1>minimax graph dump: {title}</h1><div class="meta">{meta}</div></header>
<div id="layout">
<nav><h2>Stages</h2>
{nav}
</nav>
<main>
<section><h2>Op counts per stage</h2>
<div class="muted" style="margin-bottom:6px">Green / red: the count rose / fell against the stage before. Click a stage to see its code.</div>
<div class="tablewrap">{table}</div></section>
<section id="stage"><noscript>The stage view needs JavaScript; the files NN_stage.py / .diff.txt beside this page hold the same.</noscript></section>
</main></div>
<script type="application/json" id="dump-data">{data}</script>
<script>{js}</script>
</body></html>
"""
