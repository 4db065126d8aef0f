"""HTML building blocks shared by every page: the page shell, tables, number formatting, sorting."""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from html import escape

DASH = "—"

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0 2rem 3rem;color:#1d2330}
header{border-bottom:1px solid #ccd;padding:.6rem 0;margin-bottom:1rem}
header h1{margin:.2rem 0;font-size:1.4rem} header .meta{color:#556;font-size:.85rem}
h2{margin-top:2.2rem;border-bottom:1px solid #e3e6ee} h3{margin-top:1.6rem}
table{border-collapse:collapse;font-size:.88rem;margin:.5rem 0}
th,td{border:1px solid #dde;padding:.25rem .5rem;text-align:right;vertical-align:top}
th{background:#f2f4f8} td.l,th.l{text-align:left}
table.sortable th{cursor:pointer;user-select:none} table.sortable th:after{content:" ⇅";color:#99a}
td.best{font-weight:700;background:#e4f5e4} td.best:before{content:"★ ";color:#2a8a2a}
a.def{display:inline-block;width:1.1em;height:1.1em;line-height:1.1em;border:1px solid #669;border-radius:50%;
text-align:center;font:italic 700 .7em Georgia,serif;color:#669;text-decoration:none;vertical-align:.15em}
.scroll{max-width:100%;overflow-x:auto} table:not(.leaderboard) td.l{overflow-wrap:anywhere}
.plot-title{font-weight:600;font-size:.95rem;padding:.4rem .6rem 0}
.doc td,.doc th{text-align:left}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(460px,100%),1fr));gap:1rem}
.plots.wide{grid-template-columns:1fr} .plot{min-width:0;overflow:hidden;border:1px solid #eee}
.note{color:#556;font-size:.85rem} .bad{color:#b00020} pre{background:#f6f7fa;padding:.5rem;overflow:auto}
"""

# Click a header to sort by it; numbers sort by the cell's data-v, missing values always last.
SORT_JS = """
document.querySelectorAll("table.sortable").forEach(function(t){
  t.querySelectorAll("th").forEach(function(th,i){
    th.addEventListener("click",function(){
      var body=t.tBodies[0], rows=Array.prototype.slice.call(body.rows);
      var asc=th.getAttribute("data-dir")!=="asc"; th.setAttribute("data-dir",asc?"asc":"desc");
      rows.sort(function(a,b){
        var x=a.cells[i].getAttribute("data-v"), y=b.cells[i].getAttribute("data-v");
        if(x===null||x===""){return 1;} if(y===null||y===""){return -1;}
        var nx=parseFloat(x), ny=parseFloat(y);
        var c=(isNaN(nx)||isNaN(ny))?x.localeCompare(y):nx-ny; return asc?c:-c;});
      rows.forEach(function(r){body.appendChild(r);});
    });
  });
});
"""


# Plots are drawn as the page is parsed, so each must take its box's width, and follow it when the box
# changes (window resize, a column appearing): a grid fixes the boxes' widths before any plot is drawn
# (CSS above), and a ResizeObserver redraws a plot whenever its box changes size.
PLOT_FIT_JS = """
if(window.Plotly&&window.ResizeObserver){
  var fit=new ResizeObserver(function(entries){entries.forEach(function(e){
    var d=e.target.querySelector("div.js-plotly-plot"); if(d){Plotly.Plots.resize(d);}});});
  document.querySelectorAll("div.plot").forEach(function(p){fit.observe(p);});
}
"""


def esc(value) -> str:
    return escape(str(value), quote=True)


def fmt(value, spec: str = ".4g") -> str:
    if value is None:
        return DASH
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return format(value, spec)
    return str(value)


def page(title: str, body: str, *, meta: str = "", root: str = "", scripts: Iterable[str] = ()) -> str:
    """A whole page. `root` is the relative path back to the report directory ("" or "../")."""
    script_tags = "".join(f'<script src="{esc(root + s)}"></script>' for s in scripts)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\"><title>{esc(title)}</title>"
        f"<style>{CSS}</style>{script_tags}</head><body>"
        f"<header><h1>{esc(title)}</h1><div class=\"meta\">{meta}"
        f" · <a href=\"{esc(root)}index.html\">leaderboards</a>"
        f" · <a href=\"{esc(root)}metrics.html\">metric definitions</a></div></header>"
        f"{body}<script>{SORT_JS}{PLOT_FIT_JS}</script></body></html>\n"
    )


def mapping_table(data: Mapping, cls: str = "") -> str:
    rows = "".join(
        f"<tr><th class=\"l\">{esc(k)}</th><td class=\"l\">"
        f"{esc(json.dumps(v) if isinstance(v, (dict, list)) else fmt(v))}</td></tr>"
        for k, v in data.items())
    return f"<div class=\"scroll\"><table class=\"{cls}\"><tbody>{rows}</tbody></table></div>"


def table(headers: Iterable[str], rows: Iterable[Iterable], *, sortable: bool = True, cls: str = "") -> str:
    """A table of rows of <td> strings (made by cell()); numbers sort by value."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(row) + "</tr>" for row in rows)
    classes = " ".join(c for c in ("sortable" if sortable else "", cls) if c)
    return f"<div class=\"scroll\"><table class=\"{classes}\"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"


def cell(value, spec: str = ".4g", *, extra_cls: str = "", html: str | None = None) -> str:
    """A <td> with the number in data-v for sorting; text left-aligned."""
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    cls = " ".join(c for c in ("" if numeric else "l", extra_cls) if c)
    data_v = f" data-v=\"{value!r}\"" if numeric else (f" data-v=\"{esc(value)}\"" if value is not None else "")
    return f"<td class=\"{cls}\"{data_v}>{html if html is not None else esc(fmt(value, spec))}</td>"
