// codeplane web UI: the launch form and the live run page. Plain JavaScript, no build step.
// Text from a run is inserted with textContent only (never as HTML); requests that change
// something carry the X-Codeplane-UI header the auth gate asks of cookie-signed requests.
"use strict";

const API = "/v1/background-agents";
const ENDS = new Set(["end", "interrupted"]);

async function call(method, path, body) {
  const resp = await fetch(API + path, {
    method, credentials: "same-origin",
    headers: { "content-type": "application/json", "x-codeplane-ui": "1" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const data = await resp.json().catch(() => ({}));
  if (!resp.ok) throw new Error((data.error && data.error.message) || resp.statusText);
  return data;
}

function show(id, message) {
  const el = document.getElementById(id);
  el.textContent = message;
  el.hidden = !message;
}

function node(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

function diffBlock(text) {
  const pre = node("pre", "diff");
  for (const line of text.split("\n")) {
    const kind = line.startsWith("+") && !line.startsWith("+++") ? "add"
      : line.startsWith("-") && !line.startsWith("---") ? "del"
      : line.startsWith("@@") ? "hunk" : "";
    pre.appendChild(node("span", kind, line + "\n"));
  }
  return pre;
}

function render(event) {
  const box = node("div", "event " + event.type);
  box.dataset.type = event.type;
  switch (event.type) {
    case "checkout":
      box.textContent = `Checked out ${event.repo} at ${event.commit.slice(0, 12)}`;
      break;
    case "turn_start":
      box.appendChild(node("strong", "", `Turn ${event.turn}: `));
      box.appendChild(node("span", "", event.task));
      break;
    case "model_turn": {
      const text = (event.message && event.message.content) || "";
      if (!text.trim()) return null;
      box.appendChild(node("div", "model", text));
      break;
    }
    case "user_message":
      box.appendChild(node("div", "muted", "harness: " + event.content));
      break;
    case "tool_start":
      box.appendChild(node("div", "tool-name", "▶ " + event.name));
      box.appendChild(node("pre", "args", JSON.stringify(event.arguments, null, 2)));
      break;
    case "tool_result":
      box.classList.add(event.ok ? "ok" : "failed");
      box.appendChild(node("div", "tool-name", (event.ok ? "✓ " : "✗ ") + event.name));
      box.appendChild(node("pre", "terminal", event.output));
      break;
    case "diff":
      box.appendChild(node("div", "tool-name", "Changes so far"));
      box.appendChild(diffBlock(event.diff));
      break;
    case "result":
      box.textContent = event.commit
        ? `Committed ${event.commit.slice(0, 12)} on ${event.branch}`
        : "No changes to commit";
      break;
    case "end":
    case "interrupted":
      box.textContent = `Run ${event.status || "interrupted"}${event.error ? ": " + event.error : ""}`;
      break;
    case "run_start": case "run_end":
      return null;
    default:
      box.textContent = event.type;
  }
  return box;
}

function watchRun(section) {
  const runId = section.dataset.run;
  const status = document.getElementById("status");
  let last = 0;
  let source = null;
  const open = () => {
    if (source) source.close();
    source = new EventSource(`${API}/${runId}/events`);
    source.onmessage = (message) => {
      const seq = Number(message.lastEventId);
      if (seq <= last) return; // a reopened stream starts from the first event again
      last = seq;
      const event = JSON.parse(message.data);
      const el = render(event);
      if (el) { el.dataset.seq = String(seq); section.appendChild(el); }
      if (event.type === "turn_start") status.textContent = "running";
      if (ENDS.has(event.type)) {
        status.textContent = event.status || "interrupted";
        status.className = "status " + status.textContent;
        source.close();
      }
    };
  };
  open();
  document.getElementById("stop").addEventListener("click", async () => {
    try { await call("POST", `/${runId}/cancel`); show("run-error", ""); }
    catch (err) { show("run-error", err.message); }
  });
  document.getElementById("follow-up").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const input = document.getElementById("follow-up-text");
    try {
      await call("POST", `/${runId}/messages`, { content: input.value });
      input.value = "";
      show("run-error", "");
      open(); // a finished run starts again: watch it
    } catch (err) { show("run-error", err.message); }
  });
}

function launchForm(form) {
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const data = Object.fromEntries(new FormData(form).entries());
    try {
      const run = await call("POST", "", data);
      window.location.assign(`/ui/runs/${run.id}`);
    } catch (err) { show("launch-error", err.message); }
  });
}

document.addEventListener("DOMContentLoaded", () => {
  const section = document.getElementById("events");
  if (section) watchRun(section);
  const form = document.getElementById("launch");
  if (form) launchForm(form);
});
