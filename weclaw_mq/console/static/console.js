// weclaw-mq console: the little script the server-rendered pages need. No build step, no
// dependency. Text from tasks is only ever put in the page as text (textContent); HTML comes
// only from the console's own autoescaped fragments.
"use strict";

const csrf = () => document.querySelector('meta[name="csrf-token"]').content;

async function post(url, body) {
  const response = await fetch(url, {
    method: "POST",
    headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf() },
    body: JSON.stringify(body || {}),
    credentials: "same-origin",
  });
  let data = {};
  try {
    data = await response.json();
  } catch (e) {
    data = { error: response.statusText };
  }
  if (!response.ok) throw new Error(data.error || response.statusText);
  return data;
}

function text(el, value) {
  if (el) el.textContent = value;
}

// -- live parts: [data-refresh] is re-rendered by the server every data-refresh-ms -----------
function liveRefresh(el) {
  const every = parseInt(el.dataset.refreshMs || "2000", 10);
  let busy = false;
  const tick = async () => {
    if (el.querySelector('[data-final="true"]')) return; // the task ended: nothing changes
    if (busy || document.hidden) return setTimeout(tick, every);
    busy = true;
    try {
      const response = await fetch(el.dataset.refresh, { credentials: "same-origin" });
      if (response.ok) {
        el.innerHTML = await response.text();
        el.dataset.refreshedAt = String(Date.now());
      }
    } catch (e) {
      // the console went away for a moment: try again at the next tick
    } finally {
      busy = false;
      setTimeout(tick, every);
    }
  };
  setTimeout(tick, every);
}

// -- a task's live output, relayed as Server-Sent Events ------------------------------------
function liveStream(pre) {
  const state = document.getElementById("stream-state");
  const source = new EventSource(pre.dataset.stream);
  const show = (data) => (typeof data === "string" ? data : JSON.stringify(data));
  source.addEventListener("attempt", (e) => {
    const event = JSON.parse(e.data);
    pre.textContent = ""; // a new run: its text replaces the earlier run's
    text(state, `attempt ${event.attempt} running…`);
  });
  source.addEventListener("chunk", (e) => {
    const event = JSON.parse(e.data);
    pre.append(document.createTextNode(show(event.data)));
    pre.dataset.chunks = String(parseInt(pre.dataset.chunks || "0", 10) + 1);
    text(state, `streaming (attempt ${event.attempt})…`);
  });
  source.addEventListener("problem", (e) => {
    source.close();
    text(state, `no live output: ${JSON.parse(e.data).error}`);
    pre.hidden = true;
  });
  source.addEventListener("final", (e) => {
    const event = JSON.parse(e.data);
    source.close();
    pre.dataset.final = event.status || "";
    text(state, `ended: ${event.status}${pre.textContent ? "" : " (nothing was streamed)"}`);
    pre.hidden = !pre.textContent;
  });
}

// -- the task page's actions ---------------------------------------------------------------
function taskActions(box) {
  const result = document.getElementById("action-result");
  const task = box.dataset.task;
  const queue = box.dataset.queue || null;
  box.addEventListener("click", async (e) => {
    const button = e.target.closest("button[data-action]");
    if (!button) return;
    const what = button.dataset.action;
    const ask = what === "cancel" ? `Cancel task ${task}?` : `Requeue ${task} from ${queue}.dlq?`;
    if (!window.confirm(ask)) return;
    button.disabled = true;
    try {
      if (what === "cancel") {
        const done = await post(`/api/tasks/${encodeURIComponent(task)}/cancel`, { queue });
        text(result, `cancel: ${done.outcome}`);
      } else {
        const done = await post("/api/dead-letters/requeue-one", { queue, task_id: task });
        text(result, `requeued ${done.moved} message(s) to ${done.queue}`);
      }
    } catch (err) {
      text(result, `refused: ${err.message}`);
    } finally {
      button.disabled = false;
    }
  });
}

// -- dead letters: select, preview, confirm, progress ---------------------------------------
function deadLetters(box) {
  const queue = box.dataset.queue;
  const filters = {
    task_id: box.dataset.fTaskId || "",
    error_type: box.dataset.fErrorType || "",
    reason: box.dataset.fReason || "",
    since: box.dataset.fSince || "",
    until: box.dataset.fUntil || "",
  };
  const dialog = document.getElementById("preview");
  const confirmButton = document.getElementById("confirm");
  let previewId = null;

  const selection = () => {
    if (document.getElementById("all-matching")?.checked) return null;
    return [...box.querySelectorAll("input.pick:checked")].map((c) => c.value);
  };

  async function preview(action) {
    const picked = selection();
    if (picked !== null && picked.length === 0) {
      window.alert('Select dead letters first, or tick "all matching".');
      return;
    }
    const body = { action, queue, ...filters };
    if (picked !== null) body.task_id = picked;
    let made;
    try {
      made = await post("/api/dead-letters/preview", body);
    } catch (err) {
      window.alert(`Preview refused: ${err.message}`);
      return;
    }
    previewId = made.preview_id;
    const verb = action === "requeue" ? `move back to ${queue}` : "delete for good";
    text(document.getElementById("preview-title"), `Dry run: ${action} ${made.count} dead letter(s)`);
    text(
      document.getElementById("preview-summary"),
      `These ${made.count} will ${verb} (${made.describe}); ${made.kept} stay in the DLQ. ` +
        (made.exact ? "Only the tasks listed below are touched." :
          "Too many to pin by id: the run takes this many that match the filter then."),
    );
    const tbody = document.querySelector("#preview-table tbody");
    tbody.replaceChildren();
    const more = made.count - made.dead_letters.length;
    for (const d of made.dead_letters) {
      const tr = document.createElement("tr");
      const failed = (d.last_failure_at || "-").replace("T", " ").replace("+00:00", "");
      for (const v of [d.task_id || "(no id)", d.reason, [d.error_type, d.error_message].filter(Boolean).join(": "), failed]) {
        const td = document.createElement("td");
        td.textContent = v;
        tr.append(td);
      }
      tbody.append(tr);
    }
    if (more > 0) {
      const tr = document.createElement("tr");
      const td = document.createElement("td");
      td.colSpan = 4;
      td.textContent = `… and ${more} more`;
      tr.append(td);
      tbody.append(tr);
    }
    document.getElementById("job").hidden = true;
    confirmButton.hidden = made.count === 0;
    confirmButton.disabled = false;
    text(confirmButton, action === "requeue" ? `Requeue these ${made.count}` : `Purge these ${made.count}`);
    confirmButton.classList.toggle("danger", action === "purge");
    dialog.showModal();
  }

  async function run() {
    confirmButton.disabled = true;
    const job = document.getElementById("job");
    const bar = document.getElementById("job-progress");
    const state = document.getElementById("job-state");
    job.hidden = false;
    let started;
    try {
      started = await post("/api/dead-letters/run", { preview_id: previewId });
    } catch (err) {
      text(state, `refused: ${err.message}`);
      return;
    }
    const poll = async () => {
      const response = await fetch(`/api/jobs/${encodeURIComponent(started.id)}`, { credentials: "same-origin" });
      const doc = await response.json();
      bar.max = Math.max(doc.total, 1);
      bar.value = doc.visited;
      if (doc.state === "running") {
        text(state, `${doc.visited} of ${doc.total} looked at…`);
        setTimeout(poll, 300);
      } else if (doc.state === "done") {
        const s = doc.summary;
        bar.value = bar.max;
        text(state, doc.action === "requeue"
          ? `done: moved ${s.moved}, skipped ${s.skipped}, failed ${s.failed}, left ${s.kept}`
          : `done: purged ${s.removed}, left ${s.kept}`);
        state.dataset.done = "true";
      } else {
        text(state, `failed: ${doc.error}`);
        state.dataset.done = "true";
      }
    };
    poll();
  }

  box.addEventListener("click", async (e) => {
    const one = e.target.closest("button.requeue-one");
    if (one) {
      if (!window.confirm(`Requeue ${one.dataset.task} to ${queue}?`)) return;
      one.disabled = true;
      try {
        const done = await post("/api/dead-letters/requeue-one", { queue, task_id: one.dataset.task });
        text(one, done.moved ? "requeued" : "not found");
      } catch (err) {
        text(one, "refused");
        one.title = err.message;
      }
      return;
    }
    const action = e.target.closest("button[data-action]");
    if (action) preview(action.dataset.action);
  });
  confirmButton.addEventListener("click", run);
  document.getElementById("close-preview").addEventListener("click", () => {
    dialog.close();
    if (document.getElementById("job-state").dataset.done) window.location.reload();
  });
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("[data-refresh]").forEach(liveRefresh);
  document.querySelectorAll("pre[data-stream]").forEach(liveStream);
  document.querySelectorAll(".actions[data-task]").forEach(taskActions);
  const dlq = document.getElementById("dlq");
  if (dlq) deadLetters(dlq);
  document.getElementById("logout")?.addEventListener("click", async () => {
    await post("/api/logout");
    window.location.href = "/login";
  });
});
