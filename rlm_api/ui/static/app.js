// The web view (docs/web-view.md). Every string from the API is inserted with textContent; the one exception is
// the report, which the server renders to escaped HTML (GET /v1/queries/{id}/report).
"use strict";

const KEY = "rlm.key";
const MESSAGE = "rlm.signin-message";
const TERMINAL = new Set(["done", "failed", "cancelled"]);

class Unauthorized extends Error {}
class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("data-") || k === "title" || k === "href" || k === "target" || k === "rel") node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function $(id) { return document.getElementById(id); }
function show(id, on) { $(id).hidden = !on; }
function setText(id, text) { $(id).textContent = text; }

function toSignin(message) {
  sessionStorage.removeItem(KEY);
  if (message) sessionStorage.setItem(MESSAGE, message);
  const next = location.pathname + location.search;
  location.assign("/ui/signin?next=" + encodeURIComponent(next));
}

async function api(path, options = {}) {
  const key = sessionStorage.getItem(KEY);
  if (!key) { toSignin(""); throw new Unauthorized(); }
  const headers = Object.assign({ Authorization: "Bearer " + key }, options.headers || {});
  const resp = await fetch(path, Object.assign({}, options, { headers, credentials: "omit", cache: "no-store" }));
  if (resp.status === 401) {
    toSignin("Your key was refused (revoked or unknown): sign in again.");
    throw new Unauthorized();
  }
  let body = null;
  try { body = await resp.json(); } catch (e) { body = null; }
  if (!resp.ok) {
    const msg = body && body.error ? body.error.message : "HTTP " + resp.status;
    throw new ApiError(resp.status, msg);
  }
  return body;
}

function flash(message) {
  const p = $("flash");
  p.textContent = message;
  p.hidden = !message;
}

function age(iso) {
  if (!iso) return "";
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (s < 60) return Math.round(s) + " s";
  if (s < 3600) return Math.round(s / 60) + " min";
  if (s < 86400) return Math.round(s / 3600) + " h";
  return Math.round(s / 86400) + " d";
}

// Where a chunk sits, as provenance.cite writes it (rlm_workers/search/provenance.py): "spec.pdf p. 4–5 § 2.1 Transport",
// "guide.docx:10-14 § Install" or "src/x.py:10-14". Kept in step with it: tests/test_document_tools.py compares
// what the page shows with what provenance.cite returns.
function cite(c) {
  let where = c.path + ":" + c.start_line + "-" + c.end_line;
  if (c.page_start != null) {
    const end = c.page_end == null || c.page_end === c.page_start ? "" : "\u2013" + c.page_end;
    where = c.path + " p. " + c.page_start + end;
  }
  const path = c.heading_path || [];
  return path.length ? where + " \u00a7 " + path[path.length - 1] : where;
}

function cost(usd) { return usd == null ? "—" : "$" + Number(usd).toFixed(4); }
function tokens(u) { return (u.tokens_in + u.tokens_out).toLocaleString(); }
function statusBadge(status) { return el("span", { class: "status " + status, text: status }); }

// ---------------------------------------------------------------- sign in
function signinPage() {
  // Kept until a key is accepted: two redirects here in a row (a poll's 401 racing a page load) must not
  // lose the reason on the first.
  const message = sessionStorage.getItem(MESSAGE);
  if (message) { setText("signin-error", message); show("signin-error", true); }
  $("signin-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const key = $("key").value.trim();
    const resp = await fetch("/v1/buffers", { headers: { Authorization: "Bearer " + key }, credentials: "omit" });
    if (resp.status === 401) {
      setText("signin-error", "That key was refused: check it, or create one with rlm keys create.");
      show("signin-error", true);
      return;
    }
    if (!resp.ok) {
      setText("signin-error", "The API answered HTTP " + resp.status + ": try again later.");
      show("signin-error", true);
      return;
    }
    sessionStorage.setItem(KEY, key);
    sessionStorage.removeItem(MESSAGE);
    const next = new URLSearchParams(location.search).get("next") || "/ui/";
    // Only a page of this view: never a redirect to another site.
    location.assign(next.startsWith("/ui/") ? next : "/ui/");
  });
}

// ---------------------------------------------------------------- jobs
async function jobsPage() {
  let cursor = null;
  const filters = () => {
    const p = new URLSearchParams();
    for (const [id, name] of [["f-status", "status"], ["f-buffer", "buffer"], ["f-text", "q"]]) {
      const v = $(id).value.trim();
      if (v) p.set(name, v);
    }
    return p;
  };
  async function load(more) {
    const p = filters();
    p.set("limit", "25");
    if (more && cursor) p.set("cursor", cursor);
    let page;
    try { page = await api("/v1/queries?" + p.toString()); } catch (e) { if (!(e instanceof Unauthorized)) flash(e.message); return; }
    const body = $("jobs").tBodies[0];
    if (!more) body.replaceChildren();
    for (const j of page.jobs) {
      body.append(el("tr", { "data-job": j.job_id },
        el("td", {}, statusBadge(j.status)),
        el("td", {}, el("a", { href: "/ui/jobs/" + encodeURIComponent(j.job_id), text: j.query })),
        el("td", { text: j.buffers.join(", ") }),
        el("td", { text: j.mode }),
        el("td", { text: age(j.created_at), title: j.created_at }),
        el("td", { text: tokens(j.usage) }),
        el("td", { text: cost(j.usage.cost_usd) })));
    }
    cursor = page.next_cursor;
    show("jobs-more", !!cursor);
    show("jobs-empty", body.rows.length === 0);
  }
  $("filter-form").addEventListener("submit", (ev) => { ev.preventDefault(); load(false); });
  $("jobs-more").addEventListener("click", () => load(true));
  $("submit-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    show("submit-error", false);
    let options = {};
    const raw = $("q-options").value.trim();
    if (raw) {
      try { options = JSON.parse(raw); } catch (e) { options = null; }
      if (!options || typeof options !== "object" || Array.isArray(options)) {
        setText("submit-error", "Other options: expected a JSON object such as {\"top_k\": 20}");
        show("submit-error", true);
        return;
      }
    }
    if ($("q-mode").value) options.mode = $("q-mode").value;
    const buffers = Array.from($("q-buffers").selectedOptions, (o) => o.value);
    try {
      const accepted = await api("/v1/queries", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ query: $("q-query").value, buffers, options }),
      });
      location.assign("/ui/jobs/" + encodeURIComponent(accepted.job_id));
    } catch (e) {
      if (e instanceof Unauthorized) return;
      setText("submit-error", e.message);
      show("submit-error", true);
    }
  });
  try {
    const buffers = await api("/v1/buffers");
    $("q-buffers").replaceChildren(...buffers.map((b) => el("option", { value: b.name, text: b.name })));
  } catch (e) { if (!(e instanceof Unauthorized)) flash(e.message); return; }
  await load(false);
  try {
    const batches = await api("/v1/batches");
    const body = $("batches").tBodies[0];
    body.replaceChildren(...batches.map((b) => el("tr", { "data-batch": b.batch_id },
      el("td", { text: b.batch_id }),
      el("td", {}, statusBadge(b.status)),
      el("td", { text: String(b.total) }),
      el("td", { text: Object.entries(b.counts).filter(([, n]) => n).map(([k, n]) => k + " " + n).join(", ") || "—" }),
      el("td", { text: b.tokens_spent.toLocaleString() }),
      el("td", { text: age(b.created_at), title: b.created_at || "" }))));
    show("batches-empty", batches.length === 0);
  } catch (e) { if (!(e instanceof Unauthorized)) flash(e.message); }
}

// ---------------------------------------------------------------- one job
function jobPage() {
  const jobId = document.body.dataset.subject;
  const flower = document.body.dataset.flower;
  const url = "/v1/queries/" + encodeURIComponent(jobId);
  let reportShown = false;

  function tree(children) {
    return children.map((c) => el("li", {},
      statusBadge(c.status), " ",
      el("a", { href: "/ui/jobs/" + encodeURIComponent(c.job_id), text: c.query }),
      el("span", { class: "muted", text: " (" + c.stage + ")" }),
      c.children.length ? el("ul", {}, ...tree(c.children)) : ""));
  }

  function render(v) {
    show("job", true);
    document.title = v.query.slice(0, 60) + " · rlm";
    setText("job-query", v.query);
    const st = $("job-status");
    st.textContent = v.status;
    st.className = "status " + v.status;
    setText("job-stage", v.stage);
    setText("job-buffers", v.buffers.join(", "));
    setText("job-progress", v.progress.batches_done + "/" + v.progress.batches_total + " batches");
    const u = v.usage;
    setText("job-usage", u.llm_calls + " LLM calls, " + tokens(u) + " tokens (" + u.cached_tokens + " cached), " + cost(u.cost_usd));
    if (v.parent_id) {
      const a = $("job-parent-link");
      a.href = "/ui/jobs/" + encodeURIComponent(v.parent_id);
      a.textContent = v.parent_id;
      show("job-parent", true);
    }
    if (v.error) { setText("job-error", v.error.type + ": " + v.error.message); show("job-error", true); }
    show("cancel", !TERMINAL.has(v.status));
    $("timings").tBodies[0].replaceChildren(...v.timings.map((t) =>
      el("tr", {}, el("td", { text: t.stage }), el("td", { text: t.seconds.toFixed(3) }))));
    $("grid").replaceChildren(...v.batches.map((b) => {
      const detail = "batch " + b.batch_no + ": " + b.state + ", " + b.chunks + " chunks, " + b.attempts + " attempts" +
        (b.error ? " — " + b.error.type + ": " + b.error.message : "");
      const cell = el("button", { type: "button", class: "cell " + b.state, title: detail, "data-batch": String(b.batch_no) });
      cell.addEventListener("click", () => setText("batch-detail", detail));
      return cell;
    }));
    // code mode's trace: each program and what it printed, as text (it quotes user files and model output)
    show("rounds-card", v.code_rounds.length > 0);
    $("rounds").replaceChildren(...v.code_rounds.map((r) => el("li", { "data-round": String(r.round), value: r.round },
      el("div", { class: "muted", text: (r.round === 0 ? "the stage's look at the data, no model call: " : "") + r.calls + " calls" + (r.sub_calls ? ", " + r.sub_calls + " sub-model calls" : "") +
        ", " + r.seconds.toFixed(2) + " s" + (r.ended ? ", sandbox restarted after it" : "") }),
      el("pre", { class: "program", text: r.code || "(no program)" }),
      r.output ? el("pre", { class: "output", text: r.output +
        (r.output_chars > r.output.length ? "\n[first " + r.output.length + " of " + r.output_chars + " characters]" : "") }) : "",
      r.error ? el("pre", { class: "error", text: r.error }) : "")));
    show("children-card", v.children.length > 0);
    $("children").replaceChildren(...tree(v.children));
    const sources = v.result ? v.result.sources : [];
    show("sources-card", sources.length > 0);
    $("sources").replaceChildren(...sources.map((src) => el("li", { "data-chunk": String(src.chunk_id) },
      el("a", { class: "cite", href: "#chunk-" + src.chunk_id, "data-chunk": String(src.chunk_id),
        text: "[chunk " + src.chunk_id + ", " + cite(src) + "]" }),
      el("span", { class: "muted", text: " " + src.relevance + " · " + src.buffer }),
      src.snippet ? el("div", { class: "snippet", text: src.snippet }) : "")));
    $("calls").tBodies[0].replaceChildren(...v.calls.map((c) => el("tr", {},
      el("td", { text: c.model }), el("td", { text: c.stage }), el("td", { text: c.batch == null ? "" : String(c.batch) }),
      el("td", { text: String(c.tokens_in) }), el("td", { text: String(c.tokens_out) }),
      el("td", { text: String(c.cached_tokens) }), el("td", { text: cost(c.cost_usd) }),
      el("td", { text: c.latency_ms + " ms" }),
      el("td", { text: c.status + (c.error ? ": " + c.error : ""), class: c.status }),
      el("td", { text: c.parse_ok == null ? "" : (c.parse_ok ? "yes" : "no (asked again or fell back)") }))));
    $("tasks").replaceChildren(...v.task_ids.map((t) => el("li", {},
      /^https?:\/\//i.test(flower)
        ? el("a", { href: flower + "/task/" + encodeURIComponent(t), target: "_blank", rel: "noopener noreferrer", text: t })
        : el("code", { text: t }))));
  }

  async function showReport() {
    const r = await api(url + "/report");
    if (!r.html) return;
    // Server-rendered from markdown with raw HTML escaped and only http(s)/# links (rlm_api/ui/render.py).
    $("report").innerHTML = r.html;
    reportShown = true;
  }

  async function openChunk(id) {
    show("chunk", true);
    setText("chunk-title", "chunk " + id + " …");
    setText("chunk-text", "");
    try {
      const c = await api("/v1/chunks/" + encodeURIComponent(id));
      setText("chunk-title", "chunk " + c.chunk_id + " · " + c.buffer + " · " + cite(c));
      setText("chunk-text", c.text);
    } catch (e) {
      if (!(e instanceof Unauthorized)) setText("chunk-title", "chunk " + id + ": " + e.message);
    }
  }

  $("report").addEventListener("click", (ev) => {
    const a = ev.target.closest("a.cite");
    if (!a) return;
    ev.preventDefault();
    openChunk(a.dataset.chunk);
  });
  $("sources").addEventListener("click", (ev) => {
    const a = ev.target.closest("a.cite");
    if (!a) return;
    ev.preventDefault();
    openChunk(a.dataset.chunk);
    $("chunk").scrollIntoView({ block: "nearest" });
  });
  $("chunk-close").addEventListener("click", () => show("chunk", false));
  $("cancel").addEventListener("click", async () => {
    $("cancel").disabled = true;
    try { render(await api(url, { method: "DELETE" })); } catch (e) { if (!(e instanceof Unauthorized)) flash(e.message); }
    $("cancel").disabled = false;
  });

  async function poll() {
    let v;
    try { v = await api(url); } catch (e) {
      if (e instanceof Unauthorized) return;
      if (e.status === 404) { show("job", false); show("job-missing", true); return; }
      flash(e.message);
      setTimeout(poll, 3000);
      return;
    }
    flash("");
    render(v);
    if (v.result && !reportShown) { try { await showReport(); } catch (e) { if (!(e instanceof Unauthorized)) flash(e.message); } }
    if (!TERMINAL.has(v.status)) { setTimeout(poll, 1000); return; }
    if (!reportShown) {
      $("report").replaceChildren(el("p", { class: "muted", text: v.parent_id
        ? "A follow-up job writes no report of its own: its findings went into the report of the job above it."
        : "This job ended without a report." }));
    }
  }
  poll();
}

// ---------------------------------------------------------------- buffers
async function buffersPage() {
  async function load() {
    let list;
    try { list = await api("/v1/buffers"); } catch (e) { if (!(e instanceof Unauthorized)) flash(e.message); return; }
    $("buffers").tBodies[0].replaceChildren(...list.map((b) => el("tr", { "data-buffer": b.name },
      el("td", {}, el("a", { href: "/ui/buffers/" + encodeURIComponent(b.name), text: b.name })),
      el("td", { text: String(b.files) }), el("td", { text: String(b.chunks) }),
      el("td", { text: b.bytes.toLocaleString() }), el("td", { text: b.chunker || "" }),
      el("td", { text: b.embedding_model || "" }), el("td", { text: age(b.updated_at), title: b.updated_at || "" }))));
    show("buffers-empty", list.length === 0);
  }
  $("upload-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const form = new FormData();
    form.append("name", $("u-name").value.trim());
    form.append("chunker", $("u-chunker").value);
    for (const f of $("u-files").files) form.append("files", f, f.webkitRelativePath || f.name);
    setText("upload-result", "Uploading…");
    try {
      const r = await api("/v1/buffers", { method: "POST", body: form });
      setText("upload-result", r.upload_id
        ? "Queued for an ingest worker (upload " + r.upload_id + ")."
        : "Loaded " + r.files_loaded + " files, " + r.chunks_written + " chunks into " + r.buffer.name + ".");
      await load();
    } catch (e) { if (!(e instanceof Unauthorized)) setText("upload-result", "Upload refused: " + e.message); }
  });
  await load();
}

async function bufferPage() {
  const name = document.body.dataset.subject;
  const base = "/v1/buffers/" + encodeURIComponent(name);
  let info;
  try { info = await api(base); } catch (e) {
    if (e instanceof Unauthorized) return;
    if (e.status === 404) { show("buffer-missing", true); return; }
    flash(e.message);
    return;
  }
  show("buffer", true);
  setText("buffer-name", info.name);
  const facts = [["files", info.files], ["chunks", info.chunks], ["bytes", info.bytes.toLocaleString()],
    ["version", info.version], ["chunker", info.chunker || ""], ["model", info.embedding_model || ""],
    ["runtime", info.embedding_runtime || ""], ["updated", info.updated_at || ""]];
  $("buffer-info").replaceChildren(...facts.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: String(v) })]));
  let after = null;
  async function page() {
    const p = new URLSearchParams({ limit: "200" });
    if (after) p.set("after", after);
    let files;
    try { files = await api(base + "/files?" + p.toString()); } catch (e) { if (!(e instanceof Unauthorized)) flash(e.message); return; }
    $("files").tBodies[0].append(...files.map((f) => el("tr", {},
      el("td", { text: f.path }), el("td", { text: f.bytes.toLocaleString() }),
      el("td", { text: String(f.chunks) }), el("td", { text: f.loaded_at || "" }))));
    after = files.length ? files[files.length - 1].path : after;
    show("files-more", files.length === 200);
  }
  $("files-more").addEventListener("click", page);
  await page();
}

document.addEventListener("DOMContentLoaded", () => {
  const page = document.body.dataset.page;
  const out = $("signout");
  if (out) out.addEventListener("click", () => { sessionStorage.removeItem(KEY); location.assign("/ui/signin"); });
  if (page !== "signin" && !sessionStorage.getItem(KEY)) { toSignin(""); return; }
  ({ signin: signinPage, jobs: jobsPage, job: jobPage, buffers: buffersPage, buffer: bufferPage })[page]();
});
