// The demo page: wires RealtimeClient and Conversation to the DOM in index.html.
// `window.omniDemo` exposes the live objects for debugging (and for the browser tests).

import { Conversation } from "./conversation.js";
import {
  MicrophoneError,
  RealtimeClient,
  listMicrophones,
  openMicrophone,
} from "./realtime-client.js";

const $ = (id) => document.getElementById(id);
const ui = {
  state: $("call-state"),
  microphone: $("microphone"),
  apiKey: $("api-key"),
  connect: $("connect"),
  disconnect: $("disconnect"),
  errors: $("errors"),
  you: $("you"),
  youState: $("you-state"),
  micLevel: $("mic-level"),
  agent: $("agent"),
  agentState: $("agent-state"),
  agentLevel: $("agent-level"),
  audio: $("agent-audio"),
  audioStats: $("audio-stats"),
  turns: $("turns"),
  empty: $("empty"),
  meters: {
    turnMs: [$("m-turn"), $("v-turn")],
    firstAudioMs: [$("m-first"), $("v-first")],
    cancelMs: [$("m-cancel"), $("v-cancel")],
    audioStopMs: [$("m-cut"), $("v-cut")],
  },
};

const STATE_TEXT = {
  idle: "Not connected",
  microphone: "Waiting for the microphone…",
  connecting: "Connecting…",
  connected: "Connected",
  interrupted: "Connection interrupted…",
  closed: "Disconnected",
  failed: "Connection failed",
};

// the agent's voice counts as silent below this RMS (full scale 1.0); Opus silence decodes to
// a few LSBs, speech is above 0.01
const SILENT_RMS = 0.003;
const SILENT_FOR_MS = 60;

const demo = {
  client: null,
  conversation: null,
  microphone: null,
  audioContext: null,
  meters: null,
  statsTimer: null,
  stats: null, // the latest client.audioStats(), sampled every second
  attempt: 0, // the latest press of Connect; Disconnect moves it on
  rendered: new Map(),
};
window.omniDemo = demo;

// -- connection -----------------------------------------------------------------------------

function showState(state, reason = "") {
  ui.state.dataset.state = state;
  const text = STATE_TEXT[state];
  ui.state.textContent = reason && state !== "connected" ? `${text}: ${reason}` : text;
  const busy = state === "microphone" || state === "connecting";
  const up = state === "connected" || state === "interrupted";
  ui.connect.disabled = busy || up;
  ui.disconnect.disabled = !(busy || up);
  document.body.dataset.call = state;
}

function showError(message) {
  const p = document.createElement("p");
  p.textContent = message;
  ui.errors.replaceChildren(p);
}

function clearErrors() {
  ui.errors.replaceChildren();
}

async function connect() {
  const attempt = ++demo.attempt;
  clearErrors();
  // created inside the click so the browser lets it play
  demo.audioContext ??= new AudioContext();
  demo.audioContext.resume().catch(() => {});
  showState("microphone");
  try {
    demo.microphone = await openMicrophone({ deviceId: ui.microphone.value });
  } catch (err) {
    showState("idle");
    showError(err instanceof MicrophoneError ? err.message : `Microphone: ${err.message}`);
    return;
  }
  if (attempt !== demo.attempt) {
    // Disconnect was pressed while the browser asked for the microphone
    stopMedia();
    return;
  }
  await refreshMicrophones(); // labels are readable once permission is granted

  const client = new RealtimeClient({ apiKey: ui.apiKey.value.trim() });
  const conversation = new Conversation();
  demo.client = client;
  demo.conversation = conversation;
  demo.rendered.clear();
  ui.turns.replaceChildren();
  ui.empty.hidden = false;
  resetMeters();

  client.addEventListener("state", (e) => {
    showState(e.detail.state, e.detail.reason);
    if (e.detail.state === "closed" || e.detail.state === "failed") stopMedia();
  });
  client.addEventListener("error", (e) => showError(e.detail.message));
  client.addEventListener("event", (e) => conversation.apply(e.detail));
  // a cut reply's item then holds what the caller heard of it
  client.addEventListener("conversation.item.truncated", (e) => {
    if (conversation.replyOfItem(e.detail.item_id)) {
      client.send({ type: "conversation.item.retrieve", item_id: e.detail.item_id });
    }
  });
  client.addEventListener("track", (e) => playAgent(e.detail));
  conversation.addEventListener("change", (e) => render(e.detail));

  demo.meters = startMeters(demo.microphone);
  try {
    await client.connect(demo.microphone);
  } catch (err) {
    if (client.state !== "closed") showError(`Could not connect: ${err.message}`);
    stopMedia();
    return;
  }
  demo.statsTimer = setInterval(showAudioStats, 1000);
}

async function disconnect() {
  demo.attempt++; // a connect still waiting for the microphone gives up
  const client = demo.client;
  if (client) await client.close();
  stopMedia();
  showState("closed");
}

function stopMedia() {
  clearInterval(demo.statsTimer);
  demo.statsTimer = null;
  demo.meters?.stop();
  demo.meters = null;
  for (const track of demo.microphone?.getTracks() ?? []) track.stop();
  demo.microphone = null;
  ui.audio.srcObject = null;
  setSpeaking(ui.you, ui.youState, false, "idle");
  setSpeaking(ui.agent, ui.agentState, false, "silent");
}

function playAgent(stream) {
  ui.audio.srcObject = stream;
  ui.audio.play().catch((err) => {
    showError(`The browser blocked the agent's audio (${err.name}); click anywhere to hear it.`);
    document.addEventListener("click", () => ui.audio.play().then(clearErrors), { once: true });
  });
  demo.meters?.watchAgent(stream);
}

// -- devices --------------------------------------------------------------------------------

async function refreshMicrophones() {
  const chosen = ui.microphone.value;
  let mics = [];
  try {
    mics = await listMicrophones();
  } catch {
    return;
  }
  const options = [new Option("Default microphone", "")];
  for (const mic of mics) {
    if (mic.deviceId && mic.deviceId !== "default") {
      options.push(new Option(mic.label, mic.deviceId));
    }
  }
  ui.microphone.replaceChildren(...options);
  ui.microphone.value = options.some((o) => o.value === chosen) ? chosen : "";
}

async function switchMicrophone() {
  if (!demo.client || demo.client.state !== "connected") return;
  let next;
  try {
    next = await openMicrophone({ deviceId: ui.microphone.value });
  } catch (err) {
    showError(err.message);
    return;
  }
  await demo.client.replaceMicrophone(next);
  for (const track of demo.microphone?.getTracks() ?? []) track.stop();
  demo.microphone = next;
  demo.meters?.watchMicrophone(next);
}

// -- levels: what the microphone picks up, what the agent's audio carries -------------------

function startMeters(microphone) {
  const ctx = demo.audioContext;
  const taps = { mic: null, agent: null };
  const tap = (stream) => {
    const source = ctx.createMediaStreamSource(stream);
    const analyser = ctx.createAnalyser();
    analyser.fftSize = 1024;
    source.connect(analyser);
    return { source, analyser, buffer: new Float32Array(analyser.fftSize) };
  };
  const rms = (t) => {
    if (!t) return 0;
    t.analyser.getFloatTimeDomainData(t.buffer);
    let sum = 0;
    for (const v of t.buffer) sum += v * v;
    return Math.sqrt(sum / t.buffer.length);
  };
  let quietSince = null;
  const timer = setInterval(() => {
    ui.micLevel.value = Math.min(1, rms(taps.mic) * 8);
    const level = rms(taps.agent);
    ui.agentLevel.value = Math.min(1, level * 8);
    const now = performance.now();
    if (level >= SILENT_RMS) quietSince = null;
    else if (quietSince === null) quietSince = now;
    else if (now - quietSince >= SILENT_FOR_MS) demo.conversation?.audioSilentAt(quietSince);
  }, 20);
  taps.mic = tap(microphone);
  return {
    watchAgent(stream) {
      taps.agent?.source.disconnect();
      taps.agent = tap(stream);
    },
    watchMicrophone(stream) {
      taps.mic?.source.disconnect();
      taps.mic = tap(stream);
    },
    stop() {
      clearInterval(timer);
      taps.mic?.source.disconnect();
      taps.agent?.source.disconnect();
      ui.micLevel.value = 0;
      ui.agentLevel.value = 0;
    },
  };
}

async function showAudioStats() {
  const client = demo.client;
  if (!client || client.state !== "connected") return;
  demo.stats = await client.audioStats();
  const { inbound, roundTripMs } = demo.stats;
  if (!inbound) return;
  const kb = (inbound.bytesReceived / 1024).toFixed(0);
  const parts = [
    `Agent audio received: ${inbound.packetsReceived} packets, ${kb} KiB`,
    `lost ${inbound.packetsLost ?? 0}`,
    `jitter ${((inbound.jitter ?? 0) * 1000).toFixed(0)} ms`,
  ];
  if (roundTripMs !== null) parts.push(`round trip ${roundTripMs.toFixed(0)} ms`);
  ui.audioStats.textContent = `${parts.join(", ")}.`;
}

// -- rendering ------------------------------------------------------------------------------

function setSpeaking(box, label, active, text) {
  box.dataset.active = String(active);
  label.textContent = text;
}

const AGENT_STATE_TEXT = {
  thinking: "thinking…",
  speaking: "speaking",
  generated: "speaking",
  done: "done",
  cut: "interrupted",
  failed: "failed",
};

function render(entry) {
  const c = demo.conversation;
  setSpeaking(ui.you, ui.youState, c.userSpeaking, c.userSpeaking ? "speaking" : "listening");
  setSpeaking(ui.agent, ui.agentState, c.agentSpeaking, c.agentSpeaking ? "speaking" : "silent");
  if (c.errors.length) {
    const last = c.errors[c.errors.length - 1];
    showError(`Gateway error${last.code ? ` (${last.code})` : ""}: ${last.message}`);
  }
  if (!entry) return;
  let li = demo.rendered.get(entry);
  if (!li) {
    li = turnElement(entry);
    demo.rendered.set(entry, li);
    ui.turns.append(li);
    ui.empty.hidden = true;
  }
  if (entry.kind === "user") renderUser(entry, li);
  else renderAgent(entry, li);
  li.scrollIntoView({ block: "nearest" });
  const measured = c.lastMeasured();
  if (measured) showMeters(measured.latency);
}

function turnElement(entry) {
  const li = document.createElement("li");
  li.className = `turn ${entry.kind}`;
  li.dataset.id = entry.id;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = entry.kind === "user" ? "You" : "Agent";
  const status = document.createElement("span");
  status.className = "turn-state";
  const text = document.createElement("p");
  text.className = "text";
  const latency = document.createElement("p");
  latency.className = "turn-latency";
  li.append(who, status, text, latency);
  return li;
}

function renderUser(turn, li) {
  li.dataset.state = turn.state;
  const final = turn.transcript !== null;
  const status = li.querySelector(".turn-state");
  if (turn.failed) status.textContent = `transcription failed: ${turn.failed}`;
  else if (final) status.textContent = "";
  else status.textContent = turn.state === "speaking" ? "speaking…" : "transcribing…";
  const text = li.querySelector(".text");
  text.classList.toggle("partial", !final);
  text.textContent = final ? turn.transcript || "(nothing recognized)" : turn.partial || "…";
}

function renderAgent(reply, li) {
  li.dataset.state = reply.state;
  const status = li.querySelector(".turn-state");
  status.textContent = AGENT_STATE_TEXT[reply.state] ?? reply.state;
  const text = li.querySelector(".text");
  if (reply.state === "cut") {
    // what the caller heard stays; what was generated but never played is struck out
    status.textContent = reply.cutBy === "turn_detected" ? "interrupted by you" : "cancelled";
    const mark = document.createElement("span");
    mark.className = "cut-mark";
    mark.textContent = "✂ cut";
    if (reply.heardMs !== null) mark.textContent += ` after ${seconds(reply.heardMs)}`;
    if (reply.heard === null) {
      // not yet known which words were heard: the whole reply, marked
      text.replaceChildren(document.createTextNode(`${reply.text} `), mark);
    } else {
      const heard = squash(reply.heard);
      const full = squash(reply.text);
      const rest = full.startsWith(heard) ? full.slice(heard.length) : full;
      const spoken = document.createElement("span");
      spoken.textContent = heard;
      const dropped = document.createElement("del");
      dropped.textContent = rest;
      dropped.title = "generated but never played: cut by the interruption";
      text.replaceChildren(spoken, dropped, document.createTextNode(" "), mark);
    }
  } else {
    text.textContent = reply.text || "…";
    text.classList.toggle("partial", reply.state === "thinking" || reply.state === "speaking");
  }
  if (reply.failed) status.textContent = `failed: ${reply.failed}`;
  else if (reply.incomplete && reply.state !== "cut") status.textContent += " (token limit)";
  li.querySelector(".turn-latency").textContent = latencyText(reply.latency);
}

function squash(text) {
  return text.replace(/\s+/g, " ").trim();
}

function seconds(v) {
  return `${(v / 1000).toFixed(1)} s`;
}

function ms(v) {
  return v < 10 ? `${v.toFixed(1)} ms` : `${Math.round(v)} ms`;
}

function latencyText(latency) {
  const parts = [];
  if (latency.turnMs !== undefined) parts.push(`reply ${ms(latency.turnMs)}`);
  if (latency.firstAudioMs !== undefined) parts.push(`first audio ${ms(latency.firstAudioMs)}`);
  if (latency.transcriptMs !== undefined) parts.push(`transcript ${ms(latency.transcriptMs)}`);
  if (latency.cancelMs !== undefined) parts.push(`cancel ${ms(latency.cancelMs)}`);
  if (latency.audioStopMs !== undefined) parts.push(`silent after ${ms(latency.audioStopMs)}`);
  return parts.join(" · ");
}

function showMeters(latency) {
  for (const [key, [meter, output]] of Object.entries(ui.meters)) {
    if (latency[key] === undefined) continue;
    meter.value = Math.min(meter.max, latency[key]);
    output.value = ms(latency[key]);
  }
}

function resetMeters() {
  for (const [meter, output] of Object.values(ui.meters)) {
    meter.value = 0;
    output.value = "–";
  }
  ui.audioStats.textContent = "No audio yet.";
}

// -- start ----------------------------------------------------------------------------------

ui.connect.addEventListener("click", connect);
ui.disconnect.addEventListener("click", disconnect);
ui.microphone.addEventListener("change", switchMicrophone);
navigator.mediaDevices?.addEventListener?.("devicechange", refreshMicrophones);
window.addEventListener("pagehide", () => demo.client?.close());
showState("idle");
refreshMicrophones();
