"""The report page's inline stylesheet and script (one self-contained file: nothing is fetched at view time).

The script reads the JSON in ``<script id="report-data">``, fills the step picker, the step's group table and
the token view of the chosen sample; an error anywhere is shown on the page (``#errors``) and counted in
``body[data-errors]``; ``body[data-ready="1"]`` says it finished (what the headless-browser test checks).
"""

CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0 24px 40px;color:#1d1d1f}
h1{font-size:20px;margin:18px 0 4px}h2{font-size:16px;margin:22px 0 8px}
.meta{color:#555}.note{color:#666;font-size:12px;max-width:1100px}
.grid{display:flex;flex-wrap:wrap;gap:10px}
.chart{background:#fff;border:1px solid #ddd;border-radius:4px}
.chart .frame{fill:none;stroke:#ccc}.chart .grid{stroke:#eee}.chart .tick{font-size:10px;fill:#666}
.chart .axis{font-size:10px;fill:#888}.chart .chart-title{font-size:12px;font-weight:600}
.chart .legend{font-size:11px}.chart .empty{font-size:12px;fill:#999;text-anchor:middle}
table{border-collapse:collapse;font-size:13px}td,th{border-bottom:1px solid #eee;padding:3px 8px;text-align:left;
vertical-align:top}th{background:#f6f6f6}tr.sample{cursor:pointer}tr.sample:hover{background:#f0f6ff}
tr.chosen{background:#e3efff}.taken{color:#1a7f37}.filtered,.requeued{color:#b35900}.duplicate,.undecodable{color:#888}
.prompt{max-width:420px;white-space:pre-wrap}.text{max-width:520px;white-space:pre-wrap;font-family:ui-monospace,monospace}
.num{text-align:right;font-variant-numeric:tabular-nums}
#tokens{font-family:ui-monospace,monospace;line-height:1.9;max-width:1100px;white-space:pre-wrap}
#tokens span{padding:1px 2px;margin:0 1px;border-radius:3px}
#tokens span.masked{text-decoration:line-through;text-decoration-color:#888}
#tokens span.resume,.legendbar span.resume{background:#ffd54f;color:#5d4037;font-weight:600}
.legendbar span{display:inline-block;padding:1px 6px;margin-right:4px;border-radius:3px;font-size:12px}
#errors{color:#b00020;white-space:pre-wrap}
"""

JS = r"""
(function () {
  "use strict";
  var errors = [];
  function fail(message) {
    errors.push(String(message));
    document.body.setAttribute("data-errors", String(errors.length));
    var box = document.getElementById("errors");
    if (box) { box.textContent = errors.join("\n"); }
  }
  window.addEventListener("error", function (e) { fail(e.message || e); });
  var data = JSON.parse(document.getElementById("report-data").textContent);
  var PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f"];
  var chosen = {step: null, row: null, mode: "logprob"};
  var RESUMED = "\u21bb";  // the marker between the tokens where generation resumed from a checkpoint

  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined && text !== null) { node.textContent = String(text); }
    return node;
  }
  function fmt(x, digits) {
    if (x === null || x === undefined) { return "-"; }
    return typeof x === "number" ? x.toFixed(digits === undefined ? 3 : digits) : String(x);
  }
  function cell(row, text, cls) { row.appendChild(el("td", cls ? {"class": cls} : {}, text)); }

  function showStep(step) {
    chosen.step = step;
    var body = document.getElementById("groups-body");
    body.textContent = "";
    var groups = data.details[String(step)] || [];
    var first = null;
    groups.forEach(function (g, gi) {
      var samples = g.samples && g.samples.length ? g.samples : [null];
      samples.forEach(function (s, si) {
        var row = el("tr", {"class": s ? "sample" : ""});
        if (si === 0) {
          var head = [g.offset, g.disposition + (g.reason ? ": " + g.reason : ""), g.group_id || "-",
                      g.prompt || "", g.staleness, g.generation_s === undefined ? null : g.generation_s];
          var classes = ["", g.disposition || "", "", "prompt", "num", "num"];
          head.forEach(function (v, k) {
            var td = el("td", {"class": classes[k], "rowspan": String(samples.length)},
                        k >= 4 ? fmt(v, k === 5 ? 2 : 0) : v);
            row.appendChild(td);
          });
        }
        if (s) {
          cell(row, si, "num"); cell(row, s.text, "text"); cell(row, fmt(s.reward), "num");
          cell(row, fmt(s.advantage), "num"); cell(row, s.finish); cell(row, fmt(s.version, 0), "num");
          cell(row, s.length, "num");
          row.addEventListener("click", function () { showSample(g, s, row); });
          if (first === null) { first = [g, s, row]; }
        } else {
          for (var k = 0; k < 7; k++) { cell(row, ""); }
        }
        body.appendChild(row);
      });
    });
    if (first) { showSample(first[0], first[1], first[2]); }
  }

  function colour(s, i) {
    if (chosen.mode === "logprob") {
      if (!s.logprobs) { return "#eee"; }
      var p = Math.exp(s.logprobs[i]);
      return "hsl(" + Math.round(120 * p) + ",70%,80%)";
    }
    if (chosen.mode === "version") {
      var v = s.versions[i];
      return v < 0 ? "#ddd" : PALETTE[v % PALETTE.length] + "66";
    }
    return s.mask && s.mask[i] === 0 ? "#ddd" : "#cfe3ff";
  }

  function legend(s) {
    var box = document.getElementById("token-legend");
    box.textContent = "";
    if (chosen.mode === "logprob") {
      [0.05, 0.25, 0.5, 0.75, 0.95].forEach(function (p) {
        box.appendChild(el("span", {"style": "background:hsl(" + Math.round(120 * p) + ",70%,80%)"}, "p " + p));
      });
      if (!s.logprobs) { box.appendChild(el("span", {}, "(no logprobs recorded)")); }
    } else if (chosen.mode === "version") {
      var seen = {};
      s.versions.forEach(function (v) { seen[v] = true; });
      Object.keys(seen).sort(function (a, b) { return a - b; }).forEach(function (v) {
        var c = v < 0 ? "#ddd" : PALETTE[v % PALETTE.length] + "66";
        box.appendChild(el("span", {"style": "background:" + c}, v < 0 ? "unknown" : "version " + v));
      });
    } else {
      box.appendChild(el("span", {"style": "background:#cfe3ff"}, "trained (mask 1)"));
      box.appendChild(el("span", {"style": "background:#ddd"}, "masked out (tool / environment, mask 0)"));
    }
    if (s.resumes && s.resumes.length) {
      box.appendChild(el("span", {"class": "resume"}, RESUMED + " generation resumed from a checkpoint here"));
    }
  }

  function resumeMarkers(s, i, box) {
    (s.resumes || []).forEach(function (r) {
      if (r[0] === i) {
        box.appendChild(el("span", {"class": "resume", "title": "resumed here from " + r[1] + "'s checkpoint"},
                           RESUMED));
      }
    });
  }

  function showSample(g, s, row) {
    if (chosen.row) { chosen.row.classList.remove("chosen"); }
    chosen.row = row; chosen.group = g; chosen.sample = s;
    row.classList.add("chosen");
    document.getElementById("sample-head").textContent = "step " + chosen.step + " · " + (g.group_id || "") +
      " · reward " + fmt(s.reward) + " · advantage " + fmt(s.advantage) + " · finish " + s.finish +
      " · oldest version " + fmt(s.version, 0) + " · " + s.length + " tokens" +
      (s.resumes && s.resumes.length ? " · resumed " + s.resumes.length + "\u00d7" : "") +
      (s.cut ? " (the first " + s.tokens.length + " shown; rollstream export has them all)" : "");
    var box = document.getElementById("tokens");
    box.textContent = "";
    s.tokens.forEach(function (t, i) {
      resumeMarkers(s, i, box);
      var piece = s.pieces ? s.pieces[i] : String(t);
      var masked = s.mask && s.mask[i] === 0;
      var tip = "token " + t + " · logprob " + (s.logprobs ? s.logprobs[i].toFixed(3) : "-") + " · version " +
        s.versions[i] + " · mask " + (masked ? 0 : 1);
      var span = el("span", {"title": tip, "style": "background:" + colour(s, i)}, piece);
      if (masked) { span.className = "masked"; }
      box.appendChild(span);
      box.appendChild(document.createTextNode(s.pieces ? "" : " "));
    });
    if (!s.cut) { resumeMarkers(s, s.tokens.length, box); }  // resumed after its last token
    legend(s);
  }

  try {
    var picker = document.getElementById("step-select");
    var steps = Object.keys(data.details).map(Number).sort(function (a, b) { return a - b; });
    steps.forEach(function (k) { picker.appendChild(el("option", {"value": String(k)}, "step " + k)); });
    picker.addEventListener("change", function () { showStep(Number(picker.value)); });
    document.querySelectorAll("input[name=colour]").forEach(function (input) {
      input.addEventListener("change", function () {
        chosen.mode = input.value;
        if (chosen.sample) { showSample(chosen.group, chosen.sample, chosen.row); }
      });
    });
    document.querySelectorAll("circle[data-step]").forEach(function (dot) {
      dot.addEventListener("click", function () {
        var k = dot.getAttribute("data-step");
        if (data.details[k]) { picker.value = k; showStep(Number(k)); }
      });
    });
    if (steps.length) { showStep(steps[0]); }
  } catch (e) {
    fail(e && e.stack ? e.stack : e);
  }
  document.body.setAttribute("data-ready", "1");
})();
"""
