"use strict";
// The chat page of `python -m llm serve`: streams answers from /v1/chat/completions, keeps the
// conversations in localStorage. Plain JS, no framework, no build step. Model output reaches
// the page only through renderMarkdown (escaped first) or textContent.

const STORE = "ggmlx.chat";
const DEFAULTS = {systemPrompt: "", temperature: "0.8", topP: "0.95", maxTokens: "", apiKey: ""};
const SETTINGS = {systemPrompt: "system-prompt", temperature: "temperature", topP: "top-p",
                  maxTokens: "max-tokens", apiKey: "api-key"};

// ---- markdown: escape everything, then add a few fixed tags ------------------------------

function escapeHtml(text) {
  const map = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};
  return text.replace(/[&<>"']/g, c => map[c]);
}

// Emphasis and inline code in one line of escaped text.
function renderInline(html) {
  return html.split(/(`[^`\n]+`)/).map((part, i) => {
    if (i % 2) return `<code>${part.slice(1, -1)}</code>`;
    return part
      .replace(/\*\*(?=\S)([^*\n]*?\S)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^*\w])\*(?=\S)([^*\n]*?\S)\*(?![*\w])/g, "$1<em>$2</em>")
      .replace(/(^|[^\w])_(?=\S)([^_\n]*?\S)_(?!\w)/g, "$1<em>$2</em>");
  }).join("");
}

const FENCE = /^\s*```\s*([\w+#.-]*)/;
const FENCE_END = /^\s*```\s*$/;
const UL_ITEM = /^\s*[-*+]\s+(.*)$/;
const OL_ITEM = /^\s*\d+[.)]\s+(.*)$/;
const HEADING = /^(#{1,6})\s+(.*)$/;

// Markdown to HTML: code fences, headings, lists and paragraphs of inline text. The text is
// escaped before anything else, so no tag or attribute in it survives; the tags added are fixed.
function renderMarkdown(text) {
  const lines = escapeHtml(text.replace(/\r\n?/g, "\n")).split("\n");
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      const code = [];
      for (i++; i < lines.length && !FENCE_END.test(lines[i]); i++) code.push(lines[i]);
      i++;    // the closing fence (or the end, while the answer is still streaming)
      const lang = fence[1] ? ` class="language-${fence[1]}"` : "";
      out.push(`<pre><code${lang}>${code.join("\n")}</code></pre>`);
    } else if (UL_ITEM.test(line) || OL_ITEM.test(line)) {
      const item = UL_ITEM.test(line) ? UL_ITEM : OL_ITEM;
      const items = [];
      for (; i < lines.length && item.test(lines[i]); i++) {
        items.push(`<li>${renderInline(lines[i].match(item)[1])}</li>`);
      }
      const tag = item === UL_ITEM ? "ul" : "ol";
      out.push(`<${tag}>${items.join("")}</${tag}>`);
    } else if (HEADING.test(line)) {
      const [, hashes, title] = line.match(HEADING);
      out.push(`<h${hashes.length}>${renderInline(title)}</h${hashes.length}>`);
      i++;
    } else if (!line.trim()) {
      i++;
    } else {
      const para = [];
      for (; i < lines.length && lines[i].trim() && !FENCE.test(lines[i]) && !UL_ITEM.test(lines[i])
             && !OL_ITEM.test(lines[i]) && !HEADING.test(lines[i]); i++) {
        para.push(renderInline(lines[i]));
      }
      out.push(`<p>${para.join("<br>")}</p>`);
    }
  }
  return out.join("");
}

// ---- state: conversations and settings in localStorage -----------------------------------

const $ = id => document.getElementById(id);
let state = load();
let controller = null;      // the AbortController of the answer being streamed
let attached = null;        // the image picked for the next message, as a data URL

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE));
    if (saved && Array.isArray(saved.conversations)) {
      return {...saved, settings: {...DEFAULTS, ...saved.settings}};
    }
  } catch (e) {
    console.warn("the saved conversations are unreadable; starting afresh", e);
  }
  return {conversations: [], current: null, settings: {...DEFAULTS}};
}

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(state));
  } catch (e) {
    // images can outgrow the browser's storage quota: keep the conversations without them
    const light = {...state, conversations: state.conversations.map(c => ({
      ...c, messages: c.messages.map(({image, ...m}) => (image ? {...m, imageDropped: true} : m))}))};
    localStorage.setItem(STORE, JSON.stringify(light));
    console.warn("the browser's storage is full: images are not kept after a reload", e);
  }
}

function currentConversation() {
  return state.conversations.find(c => c.id === state.current);
}

function newConversation() {
  const id = Date.now().toString(36) + Math.random().toString(36).slice(2, 6);
  state.conversations.unshift({id, title: "New chat", messages: []});
  state.current = id;
  save();
  render();
}

function deleteConversation(id) {
  state.conversations = state.conversations.filter(c => c.id !== id);
  if (state.current === id) state.current = state.conversations[0]?.id ?? null;
  save();
  render();
}

// ---- rendering ---------------------------------------------------------------------------

function statsText(s) {
  return `${s.tokens} tokens, ${s.tokensPerSecond.toFixed(1)} tokens/s, first token after ` +
         `${s.firstTokenSeconds.toFixed(2)} s${s.stopped ? " (stopped)" : ""}`;
}

// Fill a message's element; an assistant's content as markdown, its reasoning collapsed.
function fillMessage(el, msg) {
  if (msg.role !== "assistant") {
    el.textContent = msg.content;
    if (msg.image) {
      const img = document.createElement("img");
      img.className = "attached";
      img.alt = "attached image";
      img.src = msg.image;
      el.append(img);
    }
    return;
  }
  const wasOpen = el.querySelector("details")?.open ?? false;
  el.replaceChildren();
  if (msg.reasoning) {
    const details = document.createElement("details");
    details.className = "reasoning";
    details.open = wasOpen;
    const summary = document.createElement("summary");
    summary.textContent = msg.content ? "Reasoning" : "Reasoning...";
    const thoughts = document.createElement("div");
    thoughts.className = "thoughts";
    thoughts.textContent = msg.reasoning;
    details.append(summary, thoughts);
    el.append(details);
  }
  const body = document.createElement("div");
  body.className = "content";
  body.innerHTML = renderMarkdown(msg.content);
  el.append(body);
  if (msg.stats) {
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.textContent = statsText(msg.stats);
    el.append(stats);
  }
  el.classList.toggle("error", Boolean(msg.error));
}

function messageElement(msg) {
  const el = document.createElement("div");
  el.className = "message";
  el.dataset.role = msg.role;
  fillMessage(el, msg);
  return el;
}

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren();
  for (const c of state.conversations) {
    const li = document.createElement("li");
    li.classList.toggle("current", c.id === state.current);
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = c.title;
    open.addEventListener("click", () => {
      if (controller) return;
      state.current = c.id;
      save();
      render();
    });
    const del = document.createElement("button");
    del.type = "button";
    del.className = "delete";
    del.title = "Delete this conversation";
    del.textContent = "\u00d7";
    del.disabled = Boolean(controller) && c.id === state.current;
    del.addEventListener("click", () => deleteConversation(c.id));
    li.append(open, del);
    list.append(li);
  }
}

function scrollToEnd() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function render() {
  renderSidebar();
  $("messages").replaceChildren(...(currentConversation()?.messages ?? []).map(messageElement));
  scrollToEnd();
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").hidden = !busy;
  $("new-chat").disabled = busy;
}

// ---- talking to the server ---------------------------------------------------------------

function headers() {
  const h = {"Content-Type": "application/json"};
  if (state.settings.apiKey) h.Authorization = `Bearer ${state.settings.apiKey}`;
  return h;
}

function number(text) {
  return text === "" ? undefined : Number(text);
}

function requestBody(conversation) {
  const s = state.settings;
  const history = conversation.messages.slice(0, -1).filter(m => !m.error && m.content);
  // a user message with an image: OpenAI content parts, the image as a data URL
  const messages = history.map(m => ({role: m.role, content: m.image
    ? [{type: "image_url", image_url: {url: m.image}}, {type: "text", text: m.content}] : m.content}));
  if (s.systemPrompt.trim()) messages.unshift({role: "system", content: s.systemPrompt});
  return {messages, stream: true, stream_options: {include_usage: true}, temperature: number(s.temperature),
          top_p: number(s.topP), max_tokens: number(s.maxTokens)};
}

// The JSON objects of a server-sent event stream, up to `data: [DONE]`.
async function* events(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function errorMessage(response) {
  try {
    return (await response.json()).error.message;
  } catch {
    return `HTTP ${response.status}`;
  }
}

// Stream one answer into `answer` (the conversation's last message) and its element `el`.
async function streamAnswer(conversation, answer, el) {
  const t0 = performance.now();
  let tFirst = null;
  let chunks = 0;
  let usage = null;
  let lastSave = t0;
  try {
    const response = await fetch("v1/chat/completions", {method: "POST", headers: headers(),
      body: JSON.stringify(requestBody(conversation)), signal: controller.signal});
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const obj of events(response.body)) {
      if (obj.error) throw new Error(obj.error.message);
      if (obj.usage) usage = obj.usage;
      const delta = obj.choices?.[0]?.delta;
      if (!delta || !(delta.content || delta.reasoning_content)) continue;
      tFirst ??= performance.now();
      chunks++;
      answer.content += delta.content ?? "";
      answer.reasoning += delta.reasoning_content ?? "";
      fillMessage(el, answer);
      scrollToEnd();
      if (performance.now() - lastSave > 1000) {
        save();
        lastSave = performance.now();
      }
    }
  } catch (e) {
    if (e.name === "AbortError") {
      answer.stopped = true;
    } else {
      answer.error = true;
      answer.content += `${answer.content ? "\n\n" : ""}Error: ${e.message}`;
    }
  }
  const t1 = performance.now();
  const tokens = usage?.completion_tokens ?? chunks;
  if (tFirst !== null) {
    answer.stats = {tokens, tokensPerSecond: tokens / Math.max((t1 - tFirst) / 1000, 1e-3),
                    firstTokenSeconds: (tFirst - t0) / 1000, stopped: Boolean(answer.stopped)};
  }
}

async function send(text, image) {
  if (!currentConversation()) newConversation();
  const conversation = currentConversation();
  if (!conversation.messages.length) conversation.title = text.slice(0, 40);
  conversation.messages.push(image ? {role: "user", content: text, image} : {role: "user", content: text});
  const answer = {role: "assistant", content: "", reasoning: ""};
  conversation.messages.push(answer);
  save();
  controller = new AbortController();
  setBusy(true);
  render();
  const el = $("messages").lastElementChild;
  try {
    await streamAnswer(conversation, answer, el);
  } finally {
    controller = null;
    setBusy(false);
    fillMessage(el, answer);
    save();
    renderSidebar();
  }
}

async function showModel() {
  try {
    const response = await fetch("props", {headers: headers()});
    if (!response.ok) {
      $("status").textContent = response.status === 401 ? "this server needs an API key (Settings)"
                                                       : await errorMessage(response);
      return;
    }
    const props = await response.json();
    $("model-name").textContent = props.model_alias;
    $("attach-label").hidden = !props.modalities?.vision;
    const slots = props.total_slots;
    $("status").textContent = `${slots} slot${slots === 1 ? "" : "s"} of ${props.default_generation_settings.n_ctx} tokens`;
  } catch (e) {
    $("status").textContent = `the server does not answer: ${e.message}`;
  }
}

// ---- wiring ------------------------------------------------------------------------------

function dataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function setUp() {
  for (const [key, id] of Object.entries(SETTINGS)) {
    const input = $(id);
    input.value = state.settings[key];
    input.addEventListener("input", () => {
      state.settings[key] = input.value;
      save();
    });
  }
  $("api-key").addEventListener("change", showModel);
  $("settings-toggle").addEventListener("click", () => {
    const panel = $("settings");
    panel.hidden = !panel.hidden;
    $("settings-toggle").setAttribute("aria-expanded", String(!panel.hidden));
  });
  $("settings").addEventListener("submit", e => e.preventDefault());
  $("new-chat").addEventListener("click", newConversation);
  $("stop").addEventListener("click", () => controller?.abort());
  $("attach").addEventListener("change", async () => {
    const file = $("attach").files[0];
    attached = file ? await dataUrl(file) : null;
    $("attachment").textContent = file ? file.name : "";
  });
  $("composer").addEventListener("submit", e => {
    e.preventDefault();
    const text = $("input").value.trim();
    if (!text || controller) return;
    $("input").value = "";
    const image = attached;
    attached = null;
    $("attach").value = "";
    $("attachment").textContent = "";
    send(text, image);
  });
  $("input").addEventListener("keydown", e => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  render();
  showModel();
}

setUp();
