// sde2 reward inspector: sends the form to POST /v1/explain and draws the explanation.
// No framework and no other origin (the page's CSP allows only this server).
"use strict";

const FIELDS = ["completions", "answer", "recipe", "answer_type", "delta", "params", "apikey"];
const EXAMPLE_GOLD = "18";
const EXAMPLE = [
  '<strategy id="1"><reasoning>Janet has 16 eggs, eats 3 and bakes with 4, so 9 are left; she sells them at $2 each: 9 * 2 = 18.</reasoning><strategy_outcome>18</strategy_outcome></strategy>\n<strategy id="2"><reasoning>16 eggs minus the 3 she eats minus the 4 for muffins leaves 9 eggs, and 9 eggs at 2 dollars make 18 dollars.</reasoning><strategy_outcome>18</strategy_outcome></strategy>\n<final_answer>$18</final_answer>',
  'First I think. <strategy><reasoning>Count the eggs sold: 16 - 3 - 4 = 9, so she earns 9 * 2.</reasoning><strategy_outcome>20</strategy_outcome></strategy>\n<strategy><reasoning>Eggs left after breakfast and baking are 16 - 7, so 9 eggs.</reasoning><strategy_outcome>9 * 2 = 20</strategy_outcome></strategy>\n<strategy><reasoning>Work backwards from the price per egg of two dollars.</reasoning></strategy>\n<final_answer>20</final_answer>',
  '<strategy><reasoning>Each egg is worth 2 dollars and 9 are sold.</reasoning><strategy_outcome>17</strategy_outcome></strategy><strategy><reasoning>Subtract the eggs used from sixteen then double the result.</reasoning><strategy_outcome>16</strategy_outcome></strategy><strategy><reasoning>Picture the market stall and count the coins in the jar.</reasoning><strategy_outcome>15</strategy_outcome></strategy>',
  "The answer is 18.",
];

const $ = (selector, root = document) => root.querySelector(selector);

/** An element with attributes (class, text, data-*, others) and children. */
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// ---- model text -------------------------------------------------------------------------------

/** Bidirectional controls (embeddings, overrides, isolates, marks): in a model's text they can
 * make "81" read "18" on the page, so each is drawn as a visible mark instead. */
const BIDI_CONTROLS = /[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/gu;

/** ``text`` as nodes, each bidi control a visible mark naming its code point (same count of
 * code points around them: the completion's offsets still hold). */
function visible(text) {
  const nodes = [];
  let at = 0;
  for (const match of text.matchAll(BIDI_CONTROLS)) {
    if (match.index > at) nodes.push(text.slice(at, match.index));
    const code = match[0].codePointAt(0).toString(16).toUpperCase().padStart(4, "0");
    nodes.push(el("span", { class: "control", title: `U+${code}, a bidirectional control`, text: `U+${code}` }));
    at = match.index + match[0].length;
  }
  if (at < text.length) nodes.push(text.slice(at));
  return nodes;
}

/** Model text (an answer, an outcome, a reasoning): isolated from the text around it, its bidi
 * controls visible, cut to ``most`` code points ("…" when the text, of ``total`` code points
 * when the server sent a part, is longer). */
function modelText(text, most = Infinity, total = 0) {
  const points = Array.from(text);
  const cut = points.length > most || total > most;
  return el("bdi", { class: "model" }, visible(points.slice(0, most).join("")), cut ? "…" : "");
}

const fmt = (x, digits = 4) =>
  typeof x === "number" && !Number.isInteger(x) ? x.toFixed(digits) : String(x);
const signed = (x, digits = 6) => (x >= 0 ? "+" : "") + x.toFixed(digits);

// ---- input ------------------------------------------------------------------------------------

/** The items of the textarea: JSONL lines (objects or JSON strings) or one raw completion. */
function readItems(text, gold, mode = $("#input-mode").value) {
  const lines = text.split(/\r?\n/).map((l) => l.trim()).filter((l) => l.length > 0);
  const looksJsonl = lines.length > 0 && lines.every((l) => l.startsWith("{") || l.startsWith('"'));
  if (mode === "single" || (mode === "auto" && !looksJsonl)) {
    return { mode: "single", items: [{ completion: text, answer: gold }], own: [false] };
  }
  const items = [];
  const own = [];
  for (let k = 0; k < lines.length; k++) {
    let value;
    try {
      value = JSON.parse(lines[k]);
    } catch (err) {
      return { error: `line ${k + 1}: not JSON (${err.message})` };
    }
    if (typeof value === "string") value = { completion: value };
    if (value === null || typeof value !== "object" || Array.isArray(value)) {
      return { error: `line ${k + 1}: expected an object or a string` };
    }
    own.push(Object.prototype.hasOwnProperty.call(value, "answer"));
    if (!own[k] && gold !== "") value.answer = gold;
    items.push(value);
  }
  return { mode: "jsonl", items, own };
}

function describeMode() {
  const text = $("#completions").value;
  if (!text.trim()) {
    $("#mode").textContent = "Empty";
    return;
  }
  const read = readItems(text, $("#answer").value);
  $("#mode").textContent = read.error
    ? "Looks like JSONL, but " + read.error
    : read.mode === "single"
      ? `One completion (${Array.from(text).length} characters)`
      : `A group of ${read.items.length} completions (JSONL)`;
}

function clearErrors() {
  for (const name of [...FIELDS, "general"]) {
    $(`#${name}-error`).textContent = "";
    const input = document.getElementById(name);
    if (input) input.classList.remove("invalid-input");
  }
}

function showError(name, message) {
  const box = $(`#${name}-error`);
  box.textContent = box.textContent ? `${box.textContent}\n${message}` : message;
  const input = document.getElementById(name);
  if (input) input.classList.add("invalid-input");
}

/** A scored batch's warnings (x-sde2-warning headers: fetch joins their lines with ", "; each
 * starts with the field it names, such as items.3.answer or params.weights.sd, or counts the
 * rest). */
function warningsOf(headers) {
  const joined = headers.get("x-sde2-warning");
  return joined ? joined.split(/, (?=[a-z_]+(?:\.\w+)*: |and \d+ more warnings$)/) : [];
}

/** A warning next to its input: the answer stands, the input is not marked invalid. */
function showWarning(name, message) {
  const box = $(`#${name}-error`);
  const line = `warning: ${message}`;
  box.textContent = box.textContent ? `${box.textContent}\n${line}` : line;
}

/** Which input a 422 issue belongs next to. */
function inputFor(field, request) {
  const parts = field.split(".");
  if (parts[0] === "items") {
    if (parts[2] === "answer") {
      const k = Number(parts[1]);
      return request.mode === "single" || !request.own[k] ? "answer" : "completions";
    }
    return "completions";
  }
  if (field === "params.similarity_threshold" && request.deltaSet) return "delta";
  if (parts[0] === "params") return "params";
  if (["recipe", "answer_type"].includes(parts[0])) return parts[0];
  return "general";
}

function buildRequest() {
  const gold = $("#answer").value;
  const read = readItems($("#completions").value, gold);
  if (read.error) return { error: ["completions", read.error] };
  let params = {};
  const rawParams = $("#params").value.trim();
  if (rawParams) {
    try {
      params = JSON.parse(rawParams);
    } catch (err) {
      return { error: ["params", `not JSON: ${err.message}`] };
    }
    if (params === null || typeof params !== "object" || Array.isArray(params)) {
      return { error: ["params", "must be a JSON object"] };
    }
  }
  const delta = $("#delta").value.trim();
  if (delta !== "") {
    // Sent as typed when it is no number, so the server names the field in its 422.
    const typed = /^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$/.test(delta) ? Number(delta) : delta;
    // One value in two places: the one written into the parameters was replaced without a word.
    if ("similarity_threshold" in params && params.similarity_threshold !== typed) {
      return {
        error: [
          "delta",
          `δ (${delta}) and the parameters' similarity_threshold ` +
            `(${JSON.stringify(params.similarity_threshold)}) differ: clear one of them`,
        ],
      };
    }
    params.similarity_threshold = typed;
  }
  const body = {
    items: read.items,
    recipe: $("#recipe").value,
    answer_type: $("#answer_type").value,
    normalize: $("#normalize").checked,
    params,
  };
  return { body, mode: read.mode, own: read.own, deltaSet: delta !== "" };
}

// ---- run --------------------------------------------------------------------------------------

let last = null; // {request, response}
let running = false; // a request is in flight: Ctrl+Enter waits for it as the button does

/** An answer's ``detail`` as text (a proxy's may be anything). */
const detailText = (payload, response) =>
  typeof payload?.detail === "string" ? payload.detail : JSON.stringify(payload) ?? response.statusText;

async function run(event) {
  if (event) event.preventDefault();
  if (running) return;
  clearErrors();
  const request = buildRequest();
  if (request.error) {
    showError(...request.error);
    return;
  }
  const headers = { "content-type": "application/json" };
  const key = $("#apikey").value.trim();
  if (/[^\u0000-\u00ff]/u.test(key)) {
    showError("apikey", "an HTTP header cannot carry this key: characters beyond Latin-1");
    return;
  }
  if (key) headers.authorization = `Bearer ${key}`;
  $("#status").textContent = "Explaining…";
  running = true;
  $("#run").disabled = true;
  let response;
  let payload;
  try {
    // Relative to the page (/inspect): under the prefix a proxy mounts the server at, too.
    response = await fetch("v1/explain", {
      method: "POST",
      headers,
      body: JSON.stringify(request.body),
    });
    payload = await response.json().catch(() => null);
  } catch (err) {
    $("#status").textContent = "";
    showError("general", `The server did not answer: ${err.message}`);
    return;
  } finally {
    running = false;
    $("#run").disabled = false;
  }
  $("#status").textContent = `${response.status} ${response.statusText}`.trim();
  if (response.ok && !Array.isArray(payload?.explanation?.items)) {
    $("#results").hidden = true;
    showError("general", `${response.status}: the answer is not an explanation (a proxy's page?)`);
    return;
  }
  if (response.ok) {
    last = { request, response: payload };
    render(payload, request);
    for (const warning of warningsOf(response.headers)) {
      showWarning(inputFor(warning.split(":")[0], request), warning);
    }
    return;
  }
  $("#results").hidden = true;
  if (response.status === 422 && Array.isArray(payload?.detail)) {
    for (const issue of payload.detail) {
      const field = typeof issue?.field === "string" ? issue.field : "body";
      showError(inputFor(field, request), `${field}: ${issue?.msg ?? JSON.stringify(issue)}`);
    }
  } else {
    const where = response.status === 401 ? "apikey" : "general";
    showError(where, `${response.status}: ${detailText(payload, response)}`);
  }
}

// ---- results ----------------------------------------------------------------------------------

function render(payload, request) {
  const items = payload.explanation.items;
  $("#results").hidden = false;
  const normalize = payload.explanation.normalize ? "normalized over" : "not normalized;";
  $("#batch-line").textContent =
    `recipe ${payload.recipe} (${payload.explanation.components.join(", ")}), ` +
    `${normalize} ${items.length} item(s); encoder ${payload.encoder}`;
  const tbody = $("#summary tbody");
  tbody.replaceChildren();
  items.forEach((item, k) => {
    const fa = item.final_answer.text === null ? "none" : modelText(item.final_answer.text, 40);
    const row = el(
      "tr",
      { "data-item": k },
      el("td", {}, el("button", { type: "button", "data-item": k, text: `item ${k}` })),
      el("td", {
        class: `num reward ${item.reward >= 0 ? "pos" : "neg"}`,
        "data-value": item.reward,
        text: signed(item.reward),
      }),
      el("td", { class: "num", text: item.n_strat }),
      el("td", { class: "num", text: item.geometry.uniq }),
      el("td", { class: "num", text: item.chi ? "1" : "0" }),
      el("td", { class: "num", text: item.correct ? "yes" : "no" }),
      el("td", {}, fa),
    );
    tbody.append(row);
  });
  select(0, request, false);
}

function select(k, request, focus = true) {
  const items = last.response.explanation.items;
  if (k < 0 || k >= items.length) return;
  for (const row of document.querySelectorAll("#summary tbody tr")) {
    row.classList.toggle("selected", Number(row.dataset.item) === k);
  }
  if (focus) $(`#summary button[data-item="${k}"]`).focus();
  const completion = String(request.body.items[k].completion ?? "");
  const normalized = last.response.explanation.normalize;
  $("#detail").replaceChildren(detail(items[k], completion, normalized));
}

function detail(item, completion, normalized) {
  const root = el("article", { id: "item-detail", "data-item": item.index });
  root.append(
    el(
      "h2",
      {},
      `Item ${item.index}: reward `,
      el("span", {
        id: "reward",
        class: `reward-big ${item.reward >= 0 ? "pos" : "neg"}`,
        "data-value": item.reward,
        text: signed(item.reward),
      }),
      item.advantage === null ? "" : el("span", { class: "hint", text: `  advantage ${signed(item.advantage, 4)}` }),
    ),
  );
  root.append(el("h3", { text: "The completion as the parser read it" }));
  root.append(highlighted(item, completion));
  root.append(legend());
  root.append(facts(item));
  const geometry = el("div", { class: "two" });
  geometry.append(el("div", { class: "strategies-box" }, el("h3", { text: "Strategies (Uniq walk)" }), strategyList(item)));
  geometry.append(el("div", { class: "heatmap-box" }, el("h3", { text: "Cosines of H" }), heatmap(item)));
  root.append(geometry);
  root.append(el("h3", { text: "Reward components" }), components(item, normalized));
  if (item.ignored.length > 0 || item.ignored_total > 0) {
    root.append(el("h3", { text: `Ignored by the parser (${item.ignored_total})` }), ignoredTable(item));
  }
  return root;
}

/** The completion with each span of the explanation marked (offsets are code points). */
function highlighted(item, completion) {
  const chars = Array.from(completion);
  const spans = [];
  const add = (span, cls, title, badge) => {
    if (span && span[1] >= span[0]) spans.push({ start: span[0], end: span[1], cls, title, badge });
  };
  for (const block of item.strategies) {
    const label = block.status === "kept" ? `s${block.strategy}` : `b${block.block} ${block.status}`;
    const dropped = block.status === "kept" && !item.geometry.kept[block.strategy];
    add(block.span, `block-${block.status}`, block.reason || label, {
      text: dropped ? `${label} dropped` : label,
      cls: dropped ? "dropped" : block.status,
      strategy: block.strategy,
    });
    add(block.reasoning.span, "reasoning", `${label} reasoning`);
    add(block.outcome.span, "outcome", `${label} outcome`);
  }
  for (const entry of item.ignored) {
    add(entry.span, entry.kind === "outside_tags" ? "outside" : "ignored", `${entry.kind}: ${entry.reason}`);
  }
  add(item.final_answer.source !== "strategy" ? item.final_answer.span : null, "final", "final answer");
  const cuts = new Set([0, chars.length]);
  for (const s of spans) {
    cuts.add(Math.min(s.start, chars.length));
    cuts.add(Math.min(s.end, chars.length));
  }
  const points = [...cuts].sort((a, b) => a - b);
  const box = el("div", { id: "completion", tabindex: 0, "aria-label": "completion" });
  for (let i = 0; i + 1 < points.length; i++) {
    const [a, b] = [points[i], points[i + 1]];
    for (const s of spans) {
      if (s.badge && s.start === a) {
        box.append(el("span", {
          class: `badge ${s.badge.cls}`,
          "data-strategy": s.badge.strategy,
          text: s.badge.text,
        }));
      }
    }
    const covering = spans.filter((s) => s.start <= a && b <= s.end && s.end > s.start);
    const text = visible(chars.slice(a, b).join(""));
    if (covering.length === 0) {
      box.append(...text);
      continue;
    }
    box.append(el("span", {
      class: covering.map((s) => s.cls).join(" "),
      title: covering.map((s) => s.title).join(" · "),
    }, text));
  }
  if (completion.length === 0) box.append(el("span", { class: "hint", text: "(empty)" }));
  return box;
}

function legend() {
  const item = (cls, text) => el("span", { class: cls, text });
  return el(
    "div",
    { class: "legend" },
    item("block-kept", "kept strategy"),
    item("block-invalid", "invalid block"),
    item("block-duplicate", "duplicate block"),
    item("block-beyond_max", "beyond max_strategies"),
    item("reasoning", "reasoning"),
    item("outcome", "outcome"),
    item("outside", "not read"),
    item("ignored", "ignored tag"),
    item("final", "final answer"),
  );
}

function facts(item) {
  const fa = item.final_answer;
  const canon = (c) => (c && c.value !== null && c.value !== undefined ? ` → N = ${c.value}` : "");
  const source = { final_answer: "<final_answer>", answer: "<answer>", strategy: "the last kept strategy's outcome" };
  const dl = el("dl", { class: "facts" });
  const row = (term, ...value) => dl.append(el("dt", { text: term }), el("dd", {}, ...value));
  row("final answer", ...(fa.text === null ? ["none"] : ['"', modelText(fa.text), `"${canon(fa.canonical)} from ${source[fa.source]}`]));
  row("gold", '"', modelText(item.gold.text), `"${canon(item.gold.canonical)}`);
  row("correct", item.correct ? "yes: f_ans matches the gold answer" : "no");
  row("χ", item.chi ? "1: a kept strategy's outcome matches" : "0: no strategy outcome matches");
  row("strategies", `${item.n_strat} kept of ${item.blocks_total} blocks`);
  row("length", `${item.length.value} (${item.length.source})`);
  return dl;
}

function strategyList(item) {
  const g = item.geometry;
  const list = el("ul", { id: "strategies" });
  const dropped = new Map(g.dropped.map((d) => [d.strategy, d]));
  const kept = item.strategies.filter((b) => b.status === "kept");
  for (const block of kept) {
    const k = block.strategy;
    const d = dropped.get(k);
    const outcome = block.outcome;
    const li = el("li", {
      id: `strategy-${k}`,
      class: d ? "strategy dropped" : "strategy",
      "data-strategy": k,
      "data-kept": d ? "false" : "true",
    });
    li.append(el("strong", { text: `s${k}` }), d ? " dropped: " : " kept: ");
    if (d) {
      li.append(
        "duplicates ",
        el("a", { href: `#strategy-${d.duplicate_of}`, "data-duplicate-of": d.duplicate_of, text: `s${d.duplicate_of}` }),
        ` (κ ${fmt(d.cosine)} > δ ${g.threshold}) `,
      );
    }
    li.append("“", modelText(block.reasoning.text, 70, block.reasoning.chars), "” → ", modelText(outcome.text));
    li.append(outcome.matches ? " ✓" : " ✗");
    list.append(li);
  }
  const summary = el("p", { class: "hint" });
  summary.textContent = `Uniq = ${g.uniq}, Div = ${fmt(g.div)}, g = Uniq · Div = ${fmt(g.g)} (δ = ${g.threshold})`;
  return el("div", {}, list, summary);
}

function heatmap(item) {
  const g = item.geometry;
  const m = g.cosines.length;
  const table = el("table", { id: "heatmap", "data-threshold": g.threshold });
  if (m === 0) {
    table.append(el("caption", { text: "No strategy: H is empty (g = 0)." }));
    return table;
  }
  const dupPairs = new Set(g.dropped.map((d) => `${d.strategy},${d.duplicate_of}`));
  for (const d of g.dropped) dupPairs.add(`${d.duplicate_of},${d.strategy}`);
  const head = el("tr", {}, el("th"));
  for (let j = 0; j < m; j++) head.append(el("th", { class: g.kept[j] ? "" : "dropped", text: `s${j}` }));
  table.append(el("thead", {}, head));
  const body = el("tbody");
  for (let i = 0; i < m; i++) {
    const row = el("tr", {}, el("th", { class: g.kept[i] ? "" : "dropped", text: `s${i}` }));
    for (let j = 0; j < m; j++) {
      const v = g.cosines[i][j];
      const classes = [];
      if (i !== j && v > g.threshold) classes.push("over");
      if (dupPairs.has(`${i},${j}`)) classes.push("dup");
      const cell = el("td", {
        class: classes.join(" "),
        "data-i": i,
        "data-j": j,
        "data-value": v,
        title: `κ(s${i}, s${j}) = ${v}`,
        text: v.toFixed(3),
      });
      const t = Math.max(0, Math.min(1, v));
      cell.style.backgroundColor = `hsl(215, 75%, ${Math.round(97 - 52 * t)}%)`;
      if (t > 0.62) cell.style.color = "#fff";
      row.append(cell);
    }
    body.append(row);
  }
  table.append(body);
  table.append(el("caption", {
    text: `κ(h_i, h_j) of the kept strategies' reasoning. Red outline: above δ = ${g.threshold}; ` +
      "brown: the pair Uniq dropped (row and column struck).",
  }));
  return table;
}

function bar(value, scale) {
  const box = el("div", { class: "bar" }, el("div", { class: "axis" }));
  const fill = el("div", { class: value < 0 ? "fill negative" : "fill" });
  const width = scale > 0 ? (50 * Math.min(Math.abs(value), scale)) / scale : 0;
  fill.style.width = `${width}%`;
  fill.style.left = value < 0 ? `${50 - width}%` : "50%";
  box.append(fill);
  return box;
}

// Each component's share of the reward: w · R̃_k normalized over the batch, or w · R_k when the
// request turned normalization off (the explanation's "contribution" is then w times the raw value).
function components(item, normalized) {
  const term = normalized ? "R̃_k" : "R_k";
  const keys = Object.keys(item.components);
  const scaleRaw = Math.max(1, ...keys.map((k) => Math.abs(item.components[k].value)));
  const scaleNorm = Math.max(1, ...keys.map((k) => Math.abs(item.normalization[k].contribution)));
  const table = el("table", { id: "components" });
  table.append(el("thead", {}, el("tr", {},
    el("th", { text: "" }), el("th", { text: "raw R_k (formula and inputs)" }),
    el("th", { text: "batch mean / std" }), el("th", { text: `w · ${term}` }))));
  const body = el("tbody");
  for (const key of keys) {
    const c = item.components[key];
    const n = item.normalization[key];
    const inputs = Object.entries(c.inputs).map(([k, v]) => `${k} = ${typeof v === "number" ? fmt(v) : v}`).join(", ");
    body.append(el(
      "tr",
      { "data-component": key },
      el("th", { text: key }),
      el("td", {},
        el("span", { class: "num", "data-value": c.value, text: c.value.toFixed(4) }), bar(c.value, scaleRaw),
        el("div", { class: "formula", text: c.formula }), el("div", { class: "inputs", text: inputs })),
      el("td", { class: "num", text: `${fmt(n.mean)} / ${fmt(n.std)}` }),
      el("td", { class: "num" },
        el("span", { "data-value": n.contribution, text: `${signed(n.contribution, 4)}` }),
        el("div", { class: "hint", text: `w ${n.weight} × ${signed(normalized ? n.normalized : c.value, 4)}` }),
        bar(n.contribution, scaleNorm)),
    ));
  }
  body.append(el("tr", {},
    el("th", { text: "R" }), el("td", { text: `final reward = Σ_k w_k · ${term}` }), el("td"),
    el("td", { class: "num" }, el("strong", { text: signed(item.reward) }))));
  table.append(body);
  return table;
}

function ignoredTable(item) {
  const table = el("table", { id: "ignored-list" });
  table.append(el("thead", {}, el("tr", {}, el("th", { text: "what" }), el("th", { text: "where" }), el("th", { text: "why" }))));
  const body = el("tbody");
  for (const block of item.strategies.filter((b) => b.status !== "kept")) {
    body.append(el("tr", {}, el("td", { text: `block ${block.block} (${block.status})` }),
      el("td", { text: block.span.join("–") }), el("td", { text: block.reason })));
  }
  for (const entry of item.ignored) {
    const what = entry.excerpt ? [`${entry.kind}: “`, modelText(entry.excerpt.trim(), 40), "”"] : [entry.kind];
    body.append(el("tr", {}, el("td", {}, ...what), el("td", { text: entry.span.join("–") }),
      el("td", { text: entry.reason })));
  }
  table.append(body);
  const listed = item.ignored.length + item.strategies.filter((b) => b.status !== "kept").length;
  if (listed < item.ignored_total) {
    table.append(el("caption", { text: `${item.ignored_total - listed} more not listed (the explanation is bounded).` }));
  }
  return table;
}

// ---- wiring -----------------------------------------------------------------------------------

function loadExample() {
  $("#completions").value = EXAMPLE.map((c, k) => JSON.stringify({ completion: c, group: "egg-money" }) + (k < EXAMPLE.length - 1 ? "\n" : "")).join("");
  $("#answer").value = EXAMPLE_GOLD;
  describeMode();
  $("#completions").focus();
}

document.addEventListener("DOMContentLoaded", () => {
  $("#form").addEventListener("submit", run);
  $("#example").addEventListener("click", loadExample);
  $("#completions").addEventListener("input", describeMode);
  $("#answer").addEventListener("input", describeMode);
  $("#input-mode").addEventListener("change", describeMode);
  document.addEventListener("keydown", (event) => {
    if ((event.ctrlKey || event.metaKey) && event.key === "Enter") run(event);
  });
  $("#summary").addEventListener("click", (event) => {
    const button = event.target.closest("button[data-item]");
    if (button && last) select(Number(button.dataset.item), last.request);
  });
  $("#summary").addEventListener("keydown", (event) => {
    if (!last || !["ArrowDown", "ArrowUp"].includes(event.key)) return;
    const current = Number(document.querySelector("#summary tr.selected")?.dataset.item ?? 0);
    select(current + (event.key === "ArrowDown" ? 1 : -1), last.request);
    event.preventDefault();
  });
  document.addEventListener("click", (event) => {
    const link = event.target.closest("a[data-duplicate-of]");
    if (!link) return;
    for (const cell of document.querySelectorAll("#heatmap .hl")) cell.classList.remove("hl");
    const of = link.dataset.duplicateOf;
    const row = link.closest("li").dataset.strategy;
    for (const [i, j] of [[row, of], [of, row]]) {
      document.querySelector(`#heatmap td[data-i="${i}"][data-j="${j}"]`)?.classList.add("hl");
    }
  });
  describeMode();
});
