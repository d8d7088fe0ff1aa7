"""`mappa report RUN_DIR [RUN_DIR ...]`: one self-contained HTML page about training runs, readable from
file://.

It shows a run directory's metrics.jsonl (curves per agent, coach verdicts, the coach-bias audit), eval.jsonl
and episodes.jsonl (a trajectory viewer); several runs share each chart, one line style per run. Nothing is
fetched: the curves are matplotlib's SVG, inlined. Agent output is untrusted: the viewer's data travels as
JSON in a script block with every `<` escaped and the page shows it through textContent only; the charts' text
is SVG-escaped.
"""

import html
import io
import json
import math
import os
import re
import xml.etree.ElementTree as ET

from openrlhf_mappa.episode import VERDICT_STATUSES, read_jsonl

MAX_EPISODES = 200  # the viewer embeds a run's last episodes only, so a long run's report stays small
MAX_TEXT = 4000  # characters kept of each text shown in the viewer (the middle is cut)
AGENT_CURVES = ("coach_score", "outcome_success", "kl", "action_length", "tool_use_rate", "tool_error_rate",
                "code_error_rate", "truncated_rate", "answer_format_rate")
EVAL_FIELDS = ("step", "dataset", "grader", "n_problems", "n_samples")  # eval.jsonl keys that are not curves
LINE_STYLES = (("solid", "-"), ("dashed", "--"), ("dotted", ":"), ("dash-dotted", "-."))  # one per run
# Text as SVG <text> (small files; tick labels a test can read); no mathtext, so a "$" in a name is text; axes
# ending at round ticks; every point kept (no path simplification); a fixed hash salt and, in draw, no
# metadata, so the same runs give the same page.
STYLE = {"svg.fonttype": "none", "svg.hashsalt": "mappa", "text.parse_math": False, "path.simplify": False,
         "axes.autolimit_mode": "round_numbers", "axes.xmargin": 0, "axes.ymargin": 0, "font.size": 8,
         "font.sans-serif": ["DejaVu Sans"], "axes.titlelocation": "left", "axes.titleweight": "bold",
         "axes.grid": True, "grid.color": "#e4e4e4"}
SVG_NS = "http://www.w3.org/2000/svg"


def series(rows: list, key: str, name: str) -> dict:
    """(step, value) of every row where `key` is a finite number; null or NaN that step is a gap in the
    curve."""
    values = [(r["step"], r.get(key)) for r in rows]
    points = [[s, v] for s, v in values
              if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    return {"name": name, "points": points}


def chart(title: str, all_series: list, scale: list = None):
    """A chart of the series that have points, or None (e.g. KL of a run without β). `scale`: a y range the
    axis always spans."""
    kept = [s for s in all_series if s["points"]]
    return {"title": title, "series": kept, "scale": scale} if kept else None


def full_scale(key: str):
    """Scores and rates are drawn on their whole scale (0-10, 0-1), so runs and steps compare at a glance."""
    return ([0, 10] if key.endswith("coach_score")
            else [0, 1] if key.endswith(("_rate", "outcome_success")) else None)


def agent_charts(rows: list, agents: list, prefix: str = "") -> list:
    """One chart per AGENT_CURVES metric, a line per agent. No KL line for an agent whose β (kl_coef) was 0 at
    every step: with no reference model its KL is logged as 0, measured against nothing."""
    # a row without kl_coef: not known
    kl_measured = lambda a: any(r.get(f"agent/{a}/kl_coef", 1) for r in rows)
    return [chart(f"{prefix}agent/*/{k}", [series(rows, f"agent/{a}/{k}", a) for a in agents
                                           if k != "kl" or kl_measured(a)], full_scale(k))
            for k in AGENT_CURVES]


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
        "step": ep.get("step"), "success": bool(ep.get("outcome", {}).get("success")),
        "outcome": ep.get("outcome", {}),
        "task": clip(task),
        "review": review and {k: review.get(k) for k in ("status", "responsible", "coach")}
                  | {"rationale": clip(review.get("rationale"))},
        "actions": [
            {"agent": a.get("agent"), "turn": a.get("turn"), "response": clip(a.get("response_text")),
             "truncated": a.get("truncated"), "verdict": a.get("verdict"), "reward": a.get("reward"),
             "advantage": a.get("advantage"),
             "parts": {k: (v or {}).get("score") for k, v in (a.get("verdict_parts") or {}).items()},
             "feedback": {k: clip(v) if k in ("stdout", "stderr") else v
                          for k, v in (a.get("feedback") or {}).items()
                          if k in ("stdout", "stderr", "exit_code", "timed_out", "limit")}}
            for a in actions
        ],
    }


def records(path: str):
    """The records of a JSONL file of a run, or None when it does not exist; each names its step."""
    if not os.path.exists(path):
        return None
    rows = read_jsonl(path)
    for lineno, r in rows:
        if isinstance(r.get("step"), bool) or not isinstance(r.get("step"), int):
            raise ValueError(f"{path}: line {lineno}: no integer 'step' (every line of a run's "
                             f"{os.path.basename(path)} has one)")
    return [r for _, r in rows]


def load_run(run_dir: str) -> dict:
    """Everything the page shows, as one JSON-ready dict."""
    metrics, episodes, evals = (records(os.path.join(run_dir, n))
                                for n in ("metrics.jsonl", "episodes.jsonl", "eval.jsonl"))
    if metrics is None:
        raise ValueError(f"{run_dir}: no metrics.jsonl (not a run directory?)")
    episodes = episodes or []
    keys = list(dict.fromkeys(k for r in metrics for k in r))
    agents = list(dict.fromkeys([k.split("/")[1] for k in keys
                                 if k.startswith("agent/") and k.count("/") >= 2]
                                + [a["agent"] for ep in episodes for a in ep.get("actions", [])]))

    # The page opens with what a user looks at first: did the team get better, how did the coach score each
    # agent.
    training = [chart("outcome/success_rate", [series(metrics, "outcome/success_rate", "all episodes")],
                      [0, 1])]
    training += agent_charts(metrics, agents)
    coach = [
        chart("coach verdicts by status",
              [series(metrics, f"coach/verdicts_{s}", s) for s in VERDICT_STATUSES]),
        chart("coach/failure_fraction", [series(metrics, "coach/failure_fraction", "failed verdicts")],
              [0, 1]),
        chart("coach requests per step", [series(metrics, "coach/requests", "requests")]),
        chart("hindsight reviews by status",
              [series(metrics, f"coach/reviews_{s}", s) for s in VERDICT_STATUSES]),
        chart("coach latency (s)", [series(metrics, f"coach/latency_p{q}", f"p{q}") for q in (50, 90, 99)]),
        chart("coach template stage (criteria schedule)", [series(metrics, "coach/template_stage", "stage")]),
    ]
    # The first step that each coach template of a criteria schedule scored: a marker on every chart.
    stages = [(r["step"], r.get("coach/template_stage")) for r in metrics
              if r.get("coach/template_stage") is not None]
    switches = [{"step": s, "stage": k} for (_, before), (s, k) in zip(stages, stages[1:]) if k != before]
    bias = []
    for a in agents:
        prefix = f"coach_bias/{a}/"
        types = [k[len(prefix) : -len("/mean")] for k in keys if k.startswith(prefix) and k.endswith("/mean")]
        per_type = [series(metrics, f"{prefix}{t}/mean", t) for t in types]
        bias.append(chart(f"{a}: mean coach score per task type", per_type, [0, 10]))
    bias.append(chart("coach score gap between task types",
                      [series(metrics, f"coach_bias/{a}/type_gap", a) for a in agents]
                      + [series(metrics, "coach_bias/max_type_gap", "max")]))
    agreement = [series(metrics, "coach_bias/final_score_outcome_corr", "correlation")]
    for k in ("success", "failure"):
        agreement.append(series(metrics, f"coach_bias/final_score_on_{k}", f"mean score on {k}"))
    bias.append(chart("final agent's coach score vs outcome", agreement))
    evaluation = None
    if evals is not None:
        evaluation = []
        for d in dict.fromkeys(r.get("dataset", "?") for r in evals):
            rows = [r for r in evals if r.get("dataset", "?") == d]
            names = [k for k in dict.fromkeys(k for r in rows for k in r)
                     if k not in EVAL_FIELDS and not k.startswith("agent/")]
            size = f" ({rows[-1].get('n_problems', '?')} problems x {rows[-1].get('n_samples', '?')} samples)"
            # Fractions on their 0-1 axis, apart from the counts (coach requests, token counts) and the
            # coach-graded accuracy (the raw 0-10 score where the coach gives no ANSWER_CORRECT), which would
            # flatten them.
            rates = [k for k in names if k == "accuracy" or k.endswith(("_rate", "relative_score"))]
            others = [k for k in names if k not in rates and k != "accuracy_coach"]
            evaluation.append(chart(d + size, [series(rows, k, k) for k in rates], [0, 1]))
            evaluation.append(chart(f"{d}: accuracy_coach",
                                    [series(rows, "accuracy_coach", "accuracy_coach")]))
            evaluation.append(chart(f"{d}: counts and metrics", [series(rows, k, k) for k in others]))
            # behaviour on the evaluation set, as in training
            evaluation += agent_charts(rows, agents, f"{d}: ")

    return {
        "run_dir": os.path.abspath(run_dir), "steps": sorted({r["step"] for r in metrics}), "agents": agents,
        "episodes_total": len(episodes), "episodes": [episode_view(ep) for ep in episodes[-MAX_EPISODES:]],
        "bias_warning_steps": [r["step"] for r in metrics if r.get("coach_bias/warning")],
        "template_switches": switches,
        "sections": {"training": [c for c in training if c], "coach": [c for c in coach if c],
                     "bias": [c for c in bias if c],
                     "eval": None if evaluation is None else [c for c in evaluation if c]},
    }


def combine(runs: list, labels: list) -> dict:
    """The page's data for one run or several: each run's header, its episodes and its series tagged with its
    index; the charts of all runs merged by title (a chart only one run has keeps that run's lines)."""
    sections = {}
    for name in runs[0]["sections"]:
        per_run = [r["sections"][name] for r in runs]
        if all(charts is None for charts in per_run):
            sections[name] = None
            continue
        merged = {}
        for i, charts in enumerate(per_run):
            for c in charts or []:
                into = merged.setdefault(c["title"], dict(c, series=[]))
                into["series"] += [dict(s, run=i) for s in c["series"]]
        sections[name] = list(merged.values())
    head = ("run_dir", "steps", "agents", "episodes_total", "bias_warning_steps", "template_switches")
    headers = [dict({k: r[k] for k in head}, label=label, line=LINE_STYLES[i % len(LINE_STYLES)][0])
               for i, (r, label) in enumerate(zip(runs, labels))]
    return {"runs": headers,
            "episodes_total": sum(r["episodes_total"] for r in runs),
            "episodes": [dict(ep, run=i) for i, r in enumerate(runs) for ep in r["episodes"]],
            "sections": sections}


def draw(c: dict, runs: list, gid: str) -> str:
    """One chart as SVG: each series a line coloured by its name (an agent keeps its colour across runs),
    styled by its run, a dot per point; each coach template switch a dashed grey line; the legend below."""
    import matplotlib  # here: the launcher and `mappa paper-table` import this module and never draw
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    many = len(runs) > 1
    names = list(dict.fromkeys(s["name"] for s in c["series"]))
    steps = [p[0] for s in c["series"] for p in s["points"]]
    values = [p[1] for s in c["series"] for p in s["points"]]
    marks = {}  # gid: (attributes of its <g>, hover titles of its points or of the line)
    lines, labels = [], []
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(4.4, 2.3 + 0.14 * math.ceil(len(c["series"]) / 2)), layout="constrained")
        ax = fig.add_subplot(title=c["title"], xlabel="step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        for k, s in enumerate(c["series"]):
            label = (runs[s["run"]]["label"] + ": " if many else "") + s["name"]
            (line,) = ax.plot(*zip(*s["points"]), color=f"C{names.index(s['name']) % 10}", marker="o",
                              linestyle=LINE_STYLES[s["run"] % len(LINE_STYLES)][1], gid=f"{gid}s{k}",
                              markersize=3 if len(s["points"]) > 30 else 5, clip_on=False)
            marks[line.get_gid()] = ({"class": "series", "data-series": s["name"], "data-run": str(s["run"])},
                                     [f"{label}, step {x}: {y:.3g}" for x, y in s["points"]])
            lines.append(line)
            labels.append(label)
        if c["scale"]:
            ax.update_datalim([(steps[0], c["scale"][0]), (steps[0], c["scale"][1])])
        elif min(values) == max(values):  # a constant series: an axis from 0 to its value (to 1 when it is 0)
            ax.update_datalim([(steps[0], 0), (steps[0], 0 if values[0] else 1)])
        if min(steps) == max(steps):  # one step: a step either side, not a hundredth of one
            ax.set_xlim(max(0, steps[0] - 1), steps[0] + 1)
        for r, run in enumerate(runs):
            shown = [w for w in run["template_switches"] if min(steps) <= w["step"] <= max(steps)]
            for k, w in enumerate(shown):
                line = ax.axvline(w["step"], color="#888", linestyle=(0, (4, 3)), lw=1, gid=f"{gid}r{r}w{k}")
                title = f"coach template stage {w['stage']} from step {w['step']}"
                marks[line.get_gid()] = ({"class": "switch"}, [(run["label"] + ": " if many else "") + title])
        fig.legend(lines, labels, loc="outside lower center", ncols=2, frameon=False, handlelength=4)
        svg = io.StringIO()
        fig.savefig(svg, format="svg", metadata={"Creator": None, "Date": None, "Format": None, "Type": None})
    return annotate(svg.getvalue(), marks)


def annotate(svg: str, marks: dict) -> str:
    """matplotlib's SVG with what a reader hovers and a test reads: the <g> of each series or switch named
    (class, series, run) and given a <title> per point (a series' dots, in order) or for the whole (a
    switch)."""
    ET.register_namespace("", SVG_NS)  # written back as matplotlib wrote it: <svg xmlns=...>, xlink:href
    ET.register_namespace("xlink", "http://www.w3.org/1999/xlink")
    root = ET.fromstring(svg)
    for g in list(root.iter(f"{{{SVG_NS}}}g")):
        if g.get("id") in marks:
            attributes, titles = marks[g.get("id")]
            g.attrib.update(attributes)
            for target, title in zip(list(g.iter(f"{{{SVG_NS}}}use")) or [g], titles):
                ET.SubElement(target, f"{{{SVG_NS}}}title").text = title
    return ET.tostring(root, encoding="unicode")


def section(name: str, charts, runs: list) -> str:
    """A section's charts as HTML figures, or the line that says why it has none."""
    if charts is None:
        return "<p>no evaluation in this run (no eval.jsonl)</p>"
    figures = [f'<figure class="chart" data-title="{html.escape(c["title"])}">{draw(c, runs, f"{name}{i}")}'
               "</figure>" for i, c in enumerate(charts)]
    return "".join(figures) or "<p>no data in this run</p>"


def render(data: dict) -> str:
    # NaN/Infinity are not JSON: they become null. Every "<" is escaped so no agent text can close the script
    # block or open a comment in it; ASCII-only JSON also carries a lone surrogate that UTF-8 could not
    # encode.
    data = json.loads(json.dumps(data), parse_constant=lambda _: None)
    parts = {name: section(name, charts, data["runs"]) for name, charts in data.pop("sections").items()}
    parts["DATA"] = json.dumps(data).replace("<", "\\u003c")
    parts["TITLE"] = html.escape("MAPPA run " + " vs ".join(r["run_dir"] for r in data["runs"]))
    # One pass: no chart's or payload's text is ever searched for a placeholder.
    return re.sub(r"__(\w+)__", lambda m: parts[m.group(1)], TEMPLATE)


def write_report(*run_dirs: str, out: str = None) -> str:
    """The report of one run (default: RUN_DIR/report.html) or of several overlaid (RUN_A/compare.html)."""
    # Each run is named by the shortest ending of its path that tells the runs apart (runs/a/run vs
    # runs/b/run).
    parts = [os.path.abspath(d).split(os.sep) for d in run_dirs]
    n = next((n for n in range(1, max(map(len, parts)) + 1)
              if len({"/".join(p[-n:]) for p in parts}) == len(parts)), 1)
    labels = ["/".join(p[-n:]) for p in parts]
    out = out or os.path.join(run_dirs[0], "report.html" if len(run_dirs) == 1 else "compare.html")
    page = render(combine(list(map(load_run, run_dirs)), labels))
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
    return out


TEMPLATE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body { font: 14px sans-serif; margin: 1em 2em; color: #222; }
.charts { display: flex; flex-wrap: wrap; gap: 1em; }
figure.chart { margin: 0; }
#header .run { margin-bottom: 0.5em; }
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
<h2>Training curves</h2><div id="training" class="charts">__training__</div>
<h2>Coach verdicts</h2><div id="coach" class="charts">__coach__</div>
<h2>Coach-bias audit</h2><p id="bias-warning"></p><div id="bias" class="charts">__bias__</div>
<h2>Evaluation</h2><div id="eval" class="charts">__eval__</div>
<h2>Trajectories</h2>
<p id="episodes-note"></p>
<p><span id="f-run-box" hidden>run <select id="f-run"><option value="">all</option></select></span>
step <select id="f-step"><option value="">all</option></select>
outcome <select id="f-ok"><option value="">all</option><option value="true">success</option>
<option value="false">failure</option></select></p>
<div id="viewer"><ul id="episodes"></ul><div id="detail"></div></div>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const fmt = v => (v == null ? "-" : String(+(+v).toPrecision(3)));

// Data only ever becomes text (textContent) or an attribute value, never markup.
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
  if (text != null) e.textContent = text;
  return e;
}

for (const r of D.runs) {
  const steps = r.steps.length ? `${r.steps.length} (${r.steps[0]} to ${r.steps[r.steps.length - 1]})` : "none";
  const box = document.getElementById("header").appendChild(el("div", {class: "run"}));
  if (D.runs.length > 1) box.append(el("b", {}, `${r.label} (${r.line} lines)`));
  for (const [k, v] of [["run directory", r.run_dir], ["steps", steps], ["episodes", r.episodes_total],
                        ["agents", r.agents.join(", ")]])
    box.append(el("div", {}, `${k}: ${v}`));
  if (r.template_switches.length)  // dashed lines on the charts
    box.append(el("div", {}, "coach criteria switches: " +
                             r.template_switches.map(w => `stage ${w.stage} from step ${w.step}`).join(", ")));
}
const warned = D.runs.filter(r => r.bias_warning_steps.length);
document.getElementById("bias-warning").textContent = warned.length
  ? "coach-bias warning (a score gap between task types above the threshold) at steps "
    + warned.map(r => (D.runs.length > 1 ? r.label + ": " : "") + r.bias_warning_steps.join(", ")).join("; ")
  : "no coach-bias warning in this run";
const embedded = D.episodes.length;
document.getElementById("episodes-note").textContent = embedded < D.episodes_total
  ? `the last ${embedded} of ${D.episodes_total} episodes are embedded (episodes.jsonl has them all)`
  : `${D.episodes_total} episodes`;

const [runSel, stepSel, okSel] = ["f-run", "f-step", "f-ok"].map(id => document.getElementById(id));
const list = document.getElementById("episodes"), detail = document.getElementById("detail");
D.runs.forEach((r, i) => runSel.append(el("option", {value: i}, r.label)));
document.getElementById("f-run-box").hidden = D.runs.length < 2;
for (const s of [...new Set(D.episodes.map(e => e.step))].sort((a, b) => a - b))
  stepSel.append(el("option", {value: s}, "step " + s));

function showList() {
  const shown = D.episodes.filter(e => (runSel.value === "" || String(e.run) === runSel.value)
                                    && (stepSel.value === "" || String(e.step) === stepSel.value)
                                    && (okSel.value === "" || String(e.success) === okSel.value));
  list.replaceChildren(...shown.reverse().map(e => {  // newest first
    const run = D.runs.length > 1 ? D.runs[e.run].label + " | " : "";
    const li = el("li", {class: "episode" + (e.success ? " ok" : "")},
                  `${run}step ${e.step} | task ${e.task_id} | ${e.success ? "success" : "failure"} | ${e.id}`);
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
      const how = `tool: exit code ${f.exit_code}` + (f.timed_out ? ", timed out" : "")
                  + (f.limit ? `, limit ${f.limit}` : "");
      card.append(el("div", {}, how), el("pre", {class: "stdout"}, "stdout:\\n" + f.stdout),
                  el("pre", {class: "stderr"}, "stderr:\\n" + f.stderr));
    }
    card.append(el("div", {class: "reward"}, `reward ${fmt(a.reward)}, advantage ${fmt(a.advantage)}`));
    detail.append(card);
  });
}
runSel.onchange = stepSel.onchange = okSel.onchange = showList;
showList();
document.body.setAttribute("data-rendered", "1");  // reached only when no script error stopped the page
</script>
</body></html>
"""
