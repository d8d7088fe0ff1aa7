"""`mappa report RUN_DIR`: one self-contained HTML page about a training run, readable from file://.

It reads what a run writes into its run directory: metrics.jsonl (curves per agent, the coach's verdicts,
the coach-bias audit), eval.jsonl when evaluation ran, and episodes.jsonl (the trajectory viewer: every
action's output, tool feedback and coach verdict). Nothing is fetched: the charts are inline SVG drawn by
a few lines of JS. Agent output is untrusted text, so all data travels as JSON in a script block with
every `<` escaped, and the page shows it through textContent only.
"""

import html
import json
import math
import os

from openrlhf_mappa.episode import VERDICT_STATUSES, read_jsonl

MAX_EPISODES = 200  # the viewer embeds a run's last episodes only, so a long run's report stays small
MAX_TEXT = 4000  # characters kept of each text shown in the viewer (the middle is cut)
AGENT_CURVES = ("coach_score", "outcome_success", "kl", "action_length", "tool_use_rate", "tool_error_rate",
                "code_error_rate", "truncated_rate", "answer_format_rate")  # fmt: skip
EVAL_FIELDS = ("step", "dataset", "n_problems", "n_samples")  # eval.jsonl keys that are not curves


def series(rows: list, key: str, name: str) -> dict:
    """(step, value) of every row where `key` is a finite number; null or NaN that step is a gap in the curve."""
    values = [(r["step"], r.get(key)) for r in rows]
    points = [[s, v] for s, v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    return {"name": name, "points": points}


def chart(title: str, all_series: list):
    """A chart of the series that have points, or None (no empty charts: e.g. KL of a run without β)."""
    kept = [s for s in all_series if s["points"]]
    return {"title": title, "series": kept} if kept else None


def clip(text) -> str:
    """A text of at most MAX_TEXT characters, its middle cut: an untrained policy can write 16K tokens."""
    text = text if isinstance(text, str) else ""
    if len(text) <= MAX_TEXT:
        return text
    return f"{text[:MAX_TEXT // 2]}\n[... {len(text) - MAX_TEXT} characters cut ...]\n{text[-MAX_TEXT // 2:]}"


def episode_view(ep: dict) -> dict:
    """What the viewer shows of an episode: no prompts or token ids, texts clipped."""
    actions = ep.get("actions", [])
    task = next((a["coach_request"].get("task") for a in actions if a.get("coach_request")), "")
    review = ep.get("review")  # hindsight modes: the responsible action and why
    return {
        "id": ep.get("episode_id"), "task_id": ep.get("task_id"), "task_type": ep.get("task_type"),
        "step": ep.get("step"), "success": bool(ep.get("outcome", {}).get("success")), "outcome": ep.get("outcome", {}),
        "task": clip(task),
        "review": review and {k: review.get(k) for k in ("status", "responsible", "coach")} | {"rationale": clip(review.get("rationale"))},
        "actions": [
            {"agent": a.get("agent"), "turn": a.get("turn"), "response": clip(a.get("response_text")),
             "truncated": a.get("truncated"), "verdict": a.get("verdict"), "reward": a.get("reward"),
             "advantage": a.get("advantage"),
             "parts": {k: (v or {}).get("score") for k, v in (a.get("verdict_parts") or {}).items()},
             "feedback": {k: clip(v) if k in ("stdout", "stderr") else v for k, v in (a.get("feedback") or {}).items()
                          if k in ("stdout", "stderr", "exit_code", "timed_out", "limit")}}
            for a in actions
        ],
    }  # fmt: skip


def records(path: str):
    """The records of a JSONL file, or None when it does not exist."""
    return [r for _, r in read_jsonl(path)] if os.path.exists(path) else None


def load_run(run_dir: str) -> dict:
    """Everything the page shows, as one JSON-ready dict."""
    metrics, episodes, evals = (records(os.path.join(run_dir, n)) for n in ("metrics.jsonl", "episodes.jsonl", "eval.jsonl"))
    if metrics is None:
        raise ValueError(f"{run_dir}: no metrics.jsonl (not a run directory?)")
    episodes = episodes or []
    keys = list(dict.fromkeys(k for r in metrics for k in r))
    agents = list(dict.fromkeys([k.split("/")[1] for k in keys if k.startswith("agent/") and k.count("/") >= 2]
                                + [a["agent"] for ep in episodes for a in ep.get("actions", [])]))  # fmt: skip

    training = [chart(f"agent/*/{k}", [series(metrics, f"agent/{a}/{k}", a) for a in agents]) for k in AGENT_CURVES]
    training.append(chart("outcome/success_rate", [series(metrics, "outcome/success_rate", "all episodes")]))
    coach = [
        chart("coach verdicts by status", [series(metrics, f"coach/verdicts_{s}", s) for s in VERDICT_STATUSES]),
        chart("coach/failure_fraction", [series(metrics, "coach/failure_fraction", "failed verdicts")]),
        chart("coach requests per step", [series(metrics, "coach/requests", "requests")]),
        chart("hindsight reviews by status", [series(metrics, f"coach/reviews_{s}", s) for s in VERDICT_STATUSES]),
        chart("coach latency (s)", [series(metrics, f"coach/latency_p{q}", f"p{q}") for q in (50, 90, 99)]),
    ]
    bias = []
    for a in agents:
        prefix = f"coach_bias/{a}/"
        types = [k[len(prefix) : -len("/mean")] for k in keys if k.startswith(prefix) and k.endswith("/mean")]
        per_type = [series(metrics, f"{prefix}{t}/mean", t) for t in types]
        bias.append(chart(f"{a}: mean coach score per task type", per_type))
    bias.append(chart("coach score gap between task types",
                      [series(metrics, f"coach_bias/{a}/type_gap", a) for a in agents]
                      + [series(metrics, "coach_bias/max_type_gap", "max")]))  # fmt: skip
    agreement = [series(metrics, "coach_bias/final_score_outcome_corr", "correlation")]
    for k in ("success", "failure"):
        agreement.append(series(metrics, f"coach_bias/final_score_on_{k}", f"mean score on {k}"))
    bias.append(chart("final agent's coach score vs outcome", agreement))
    evaluation = None
    if evals is not None:
        datasets = list(dict.fromkeys(r.get("dataset", "?") for r in evals))
        evaluation = []
        for d in datasets:
            rows = [r for r in evals if r.get("dataset", "?") == d]
            names = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in EVAL_FIELDS and not k.startswith("agent/")]
            size = f" ({rows[-1].get('n_problems', '?')} problems x {rows[-1].get('n_samples', '?')} samples)"
            evaluation.append(chart(d + size, [series(rows, k, k) for k in names]))
            # Behaviour on the evaluation set: one chart per metric, a line per agent, as in training.
            evaluation += [chart(f"{d}: agent/*/{k}", [series(rows, f"agent/{a}/{k}", a) for a in agents]) for k in AGENT_CURVES]

    steps = sorted({r["step"] for r in metrics})
    return {
        "run_dir": os.path.abspath(run_dir),
        "steps": steps,
        "agents": agents,
        "episodes_total": len(episodes),
        "episodes": [episode_view(ep) for ep in episodes[-MAX_EPISODES:]],
        "bias_warning_steps": [r["step"] for r in metrics if r.get("coach_bias/warning")],
        "sections": {
            "training": [c for c in training if c],
            "coach": [c for c in coach if c],
            "bias": [c for c in bias if c],
            "eval": None if evaluation is None else [c for c in evaluation if c],
        },
    }


def render(data: dict) -> str:
    # NaN/Infinity (e.g. in an outcome's metric) are not JSON: they become null. Every "<" is escaped so no
    # agent text can close the script block ("</script>") or open a comment in it; ASCII-only JSON also
    # carries a lone surrogate (an escape in a hand-edited JSONL file) that UTF-8 could not encode.
    data = json.loads(json.dumps(data), parse_constant=lambda _: None)
    payload = json.dumps(data).replace("<", "\\u003c")
    title = html.escape(f"MAPPA run {data['run_dir']}")
    before, after = TEMPLATE.split("__DATA__")  # the payload is never searched for a placeholder
    return before.replace("__TITLE__", title) + payload + after


def write_report(run_dir: str, out: str = None) -> str:
    out = out or os.path.join(run_dir, "report.html")
    page = render(load_run(run_dir))
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
    return out


TEMPLATE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body { font: 14px sans-serif; margin: 1em 2em; color: #222; }
.charts { display: flex; flex-wrap: wrap; gap: 1em; }
figure.chart { margin: 0; } .legend span { margin-right: 1em; white-space: nowrap; }
#viewer { display: flex; gap: 1em; align-items: flex-start; }
#episodes { list-style: none; padding: 0; margin: 0; width: 28em; max-height: 80vh; overflow-y: auto; }
#episodes li { padding: 2px 4px; cursor: pointer; border-left: 4px solid #c33; font-size: 12px; }
#episodes li.ok { border-left-color: #3a3; } #episodes li.sel { background: #dde; }
#detail { flex: 1; min-width: 0; } .action { border-radius: 6px; padding: 6px 10px; margin: 8px 0; }
pre { white-space: pre-wrap; word-break: break-all; background: #fff8; padding: 4px; margin: 4px 0;
      max-height: 24em; overflow-y: auto; }
</style></head>
<body>
<h1>MAPPA training report</h1>
<div id="header"></div>
<h2>Training curves</h2><div id="training" class="charts"></div>
<h2>Coach verdicts</h2><div id="coach" class="charts"></div>
<h2>Coach-bias audit</h2><p id="bias-warning"></p><div id="bias" class="charts"></div>
<h2>Evaluation</h2><div id="eval" class="charts"></div>
<h2>Trajectories</h2>
<p id="episodes-note"></p>
<p>step <select id="f-step"><option value="">all</option></select>
outcome <select id="f-ok"><option value="">all</option><option value="true">success</option>
<option value="false">failure</option></select></p>
<div id="viewer"><ul id="episodes"></ul><div id="detail"></div></div>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
const fmt = v => (v == null ? "-" : String(+(+v).toPrecision(3)));

// Data only ever becomes text (textContent) or an attribute value, never markup.
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
  if (text != null) e.textContent = text;
  return e;
}
function svg(parent, tag, attrs, text) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text != null) e.textContent = text;
  return parent.appendChild(e);
}

// One chart: each series [[step, value], ...] a polyline over shared axes, a dot per point whose hover
// title gives the value, and a legend.
function chart(c) {
  const W = 380, H = 210, L = 50, R = 12, T = 22, B = 30;
  const pts = c.series.flatMap(s => s.points);
  let x0 = Math.min(...pts.map(p => p[0])), x1 = Math.max(...pts.map(p => p[0]));
  let y0 = Math.min(...pts.map(p => p[1])), y1 = Math.max(...pts.map(p => p[1]));
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= 1; y1 += 1; }
  const X = x => (L + (x - x0) / (x1 - x0) * (W - L - R)).toFixed(1);
  const Y = y => (H - B - (y - y0) / (y1 - y0) * (H - T - B)).toFixed(1);
  const fig = el("figure", {class: "chart", "data-title": c.title});
  const s = svg(fig, "svg", {width: W, height: H});
  svg(s, "text", {x: L, y: 14, "font-weight": "bold"}, c.title);
  svg(s, "polyline", {class: "axis", points: `${L},${T} ${L},${H - B} ${W - R},${H - B}`, fill: "none", stroke: "#888"});
  svg(s, "text", {x: L - 4, y: H - B, "text-anchor": "end", "font-size": 11}, fmt(y0));
  svg(s, "text", {x: L - 4, y: T + 8, "text-anchor": "end", "font-size": 11}, fmt(y1));
  svg(s, "text", {x: L, y: H - B + 14, "font-size": 11}, "step " + fmt(x0));
  svg(s, "text", {x: W - R, y: H - B + 14, "text-anchor": "end", "font-size": 11}, fmt(x1));
  const legend = el("div", {class: "legend"});
  c.series.forEach((ser, i) => {
    const color = COLORS[i % COLORS.length];
    svg(s, "polyline", {class: "series", "data-series": ser.name, fill: "none", stroke: color, "stroke-width": 1.5,
                        points: ser.points.map(p => X(p[0]) + "," + Y(p[1])).join(" ")});
    for (const p of ser.points) {
      const dot = svg(s, "circle", {cx: X(p[0]), cy: Y(p[1]), r: 3, fill: color});
      svg(dot, "title", {}, `${ser.name}, step ${p[0]}: ${fmt(p[1])}`);
    }
    const item = legend.appendChild(el("span", {}, " " + ser.name));
    item.prepend(el("b", {style: "color:" + color}, "\u25a0"));
  });
  fig.append(legend);
  return fig;
}

const steps = D.steps.length ? `${D.steps.length} (${D.steps[0]} to ${D.steps[D.steps.length - 1]})` : "none";
const header = [["run directory", D.run_dir], ["steps", steps], ["episodes", D.episodes_total], ["agents", D.agents.join(", ")]];
for (const [k, v] of header) document.getElementById("header").append(el("div", {}, `${k}: ${v}`));
for (const [name, charts] of Object.entries(D.sections)) {
  const box = document.getElementById(name);
  if (charts === null) box.append(el("p", {}, "no evaluation in this run (no eval.jsonl)"));
  else if (!charts.length) box.append(el("p", {}, "no data in this run"));
  else for (const c of charts) box.append(chart(c));
}
document.getElementById("bias-warning").textContent = D.bias_warning_steps.length
  ? "coach-bias warning (a score gap between task types above the threshold) at steps " + D.bias_warning_steps.join(", ")
  : "no coach-bias warning in this run";
document.getElementById("episodes-note").textContent = D.episodes.length < D.episodes_total
  ? `the last ${D.episodes.length} of ${D.episodes_total} episodes are embedded (episodes.jsonl has them all)`
  : `${D.episodes_total} episodes`;

const stepSel = document.getElementById("f-step"), okSel = document.getElementById("f-ok");
const list = document.getElementById("episodes"), detail = document.getElementById("detail");
for (const s of new Set(D.episodes.map(e => e.step))) stepSel.append(el("option", {value: s}, "step " + s));

function showList() {
  const shown = D.episodes.filter(e => (stepSel.value === "" || String(e.step) === stepSel.value)
                                    && (okSel.value === "" || String(e.success) === okSel.value));
  list.replaceChildren(...shown.reverse().map(e => {  // newest first
    const li = el("li", {class: "episode" + (e.success ? " ok" : "")},
                  `step ${e.step} | task ${e.task_id} | ${e.success ? "success" : "failure"} | ${e.id}`);
    li.onclick = () => showEpisode(e, li);
    return li;
  }));
  if (shown.length) showEpisode(shown[0], list.firstChild);
  else detail.replaceChildren(el("p", {}, "no episode matches"));
}

// Each action in order, its card coloured by the coach's score: red 0 to green 10, grey without a score.
function showEpisode(e, li) {
  for (const x of list.children) x.classList.toggle("sel", x === li);
  detail.replaceChildren(el("h3", {}, `episode ${e.id} (task ${e.task_id}, ${e.task_type || "-"}, step ${e.step})`),
                         el("pre", {class: "task"}, e.task), el("div", {}, "outcome: " + JSON.stringify(e.outcome)));
  const r = e.review;
  if (r) detail.append(el("div", {class: "review"}, r.status === "ok"
    ? `hindsight review (${r.coach}): action ${r.responsible + 1} held responsible for the outcome: ${r.rationale}`
    : `hindsight review failed (${r.status}): ${r.rationale}`));
  e.actions.forEach((a, i) => {
    const v = a.verdict, score = v && v.score != null ? v.score : null, f = a.feedback;
    const card = el("div", {class: "action", "data-agent": a.agent});
    card.style.background = score == null ? "#ddd" : `hsl(${score * 12}, 70%, 85%)`;
    const verdict = score != null ? `coach score ${fmt(score)}` : `no score: ${v ? v.status : "no verdict"}`;
    const parts = Object.entries(a.parts || {}).map(([k, p]) => `${k} ${fmt(p)}`).join(", ");
    const blamed = r && r.status === "ok" && r.responsible === i ? " - held responsible for the outcome" : "";
    card.append(el("h4", {}, `${a.agent}, turn ${a.turn}` + (a.truncated ? " (hit the token limit)" : "") + blamed),
                el("div", {class: "score"}, verdict + (parts ? ` (${parts})` : "")),
                el("pre", {class: "rationale"}, v ? `${v.coach}: ${v.rationale}` : ""),
                el("div", {}, "response:"), el("pre", {class: "response"}, a.response));
    if (f.exit_code != null || f.timed_out) {
      const how = `tool: exit code ${f.exit_code}` + (f.timed_out ? ", timed out" : "") + (f.limit ? `, limit ${f.limit}` : "");
      card.append(el("div", {}, how), el("pre", {class: "stdout"}, "stdout:\\n" + f.stdout),
                  el("pre", {class: "stderr"}, "stderr:\\n" + f.stderr));
    }
    card.append(el("div", {class: "reward"}, `reward ${fmt(a.reward)}, advantage ${fmt(a.advantage)}`));
    detail.append(card);
  });
}
stepSel.onchange = okSel.onchange = showList;
showList();
</script>
</body></html>
"""
