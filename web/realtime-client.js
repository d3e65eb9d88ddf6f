// A browser client for omni-gateway's WebRTC calls: the OpenAI Realtime WebRTC shape.
//
//   import { RealtimeClient, openMicrophone } from "/web/realtime-client.js";
//   const mic = await openMicrophone();                    // MicrophoneError explains refusals
//   const client = new RealtimeClient({ apiKey });         // apiKey is optional
//   client.addEventListener("response.done", (e) => console.log(e.detail));
//   client.addEventListener("track", (e) => (audio.srcObject = e.detail));
//   await client.connect(mic);                             // resolves once events can flow
//   await client.close();
//
// Every server event is dispatched twice, as "event" and under its own type, each a CustomEvent
// whose detail is the event with `receivedAt` (performance.now() at arrival) added. The client
// also dispatches "state" (detail: {state, reason}), "track" (detail: the agent's MediaStream)
// and "error" (detail: an Error) for failures of the call itself. No dependencies, no build step.

export const CALLS_PATH = "/v1/realtime/calls";
// the gateway's own events (omni.*: first audio, cancel acknowledged) beside OpenAI's, which
// the page shows; the gateway sends them only to clients that ask
export const OMNI_EVENTS = "?omni_events=on";
export const EVENTS_CHANNEL = "oai-events";

/** Why the microphone could not be opened; `kind` is one of MicrophoneError.KINDS. */
export class MicrophoneError extends Error {
  static KINDS = [
    "denied",
    "not-found",
    "busy",
    "insecure",
    "unsupported",
    "constraint",
    "unknown",
  ];

  constructor(kind, message, cause) {
    super(message, { cause });
    this.name = "MicrophoneError";
    this.kind = kind;
  }
}

/** A call the gateway refused or could not set up; `status` is the HTTP status (0: no answer). */
export class CallError extends Error {
  constructor(message, { status = 0, code = null, retryAfterS = null } = {}) {
    super(message);
    this.name = "CallError";
    this.status = status;
    this.code = code;
    this.retryAfterS = retryAfterS;
  }
}

/** The default capture settings: a voice call, so the browser's echo canceller stays on (the
 * agent heard through a loudspeaker would otherwise barge in on itself). */
export const VOICE_CONSTRAINTS = {
  echoCancellation: true,
  noiseSuppression: true,
  autoGainControl: true,
  channelCount: 1,
};

/** Open a microphone (the default one, or `deviceId`), turning the browser's refusals into
 * MicrophoneErrors a person can act on. */
export async function openMicrophone({ deviceId = "", constraints = VOICE_CONSTRAINTS } = {}) {
  if (!globalThis.isSecureContext) {
    throw new MicrophoneError(
      "insecure",
      "The browser only allows the microphone on https:// pages or on localhost. " +
        "Open this page through https or on http://localhost.",
    );
  }
  if (!navigator.mediaDevices?.getUserMedia) {
    throw new MicrophoneError(
      "unsupported",
      "This browser cannot capture audio (no getUserMedia).",
    );
  }
  const audio = { ...constraints };
  if (deviceId) audio.deviceId = { exact: deviceId };
  try {
    return await navigator.mediaDevices.getUserMedia({ audio, video: false });
  } catch (err) {
    throw microphoneError(err);
  }
}

function microphoneError(err) {
  switch (err?.name) {
    case "NotAllowedError":
    case "SecurityError":
      return new MicrophoneError(
        "denied",
        "Microphone access was refused. Allow it in the browser's site settings " +
          "(the icon left of the address), then connect again.",
        err,
      );
    case "NotFoundError":
      return new MicrophoneError(
        "not-found",
        "No microphone was found. Plug one in or enable it, then connect again.",
        err,
      );
    case "NotReadableError":
    case "AbortError":
      return new MicrophoneError(
        "busy",
        "The microphone could not be started: another application may be using it.",
        err,
      );
    case "OverconstrainedError":
      return new MicrophoneError(
        "constraint",
        "The selected microphone is no longer available. Pick another one.",
        err,
      );
    default:
      return new MicrophoneError("unknown", `The microphone failed: ${err?.message ?? err}`, err);
  }
}

/** The audio inputs the browser offers: [{deviceId, label}]. Labels are empty until the page
 * has been granted the microphone once; those get "Microphone N". */
export async function listMicrophones() {
  if (!navigator.mediaDevices?.enumerateDevices) return [];
  const devices = await navigator.mediaDevices.enumerateDevices();
  return devices
    .filter((d) => d.kind === "audioinput")
    .map((d, i) => ({ deviceId: d.deviceId, label: d.label || `Microphone ${i + 1}` }));
}

/** One WebRTC call to the gateway: audio both ways and the "oai-events" data channel. */
export class RealtimeClient extends EventTarget {
  /**
   * @param {object} [options]
   * @param {string} [options.baseUrl]  the gateway's origin; "" is the page's own
   * @param {string} [options.apiKey]  sent as `Authorization: Bearer ...` when given
   * @param {RTCIceServer[]} [options.iceServers]  none by default: the gateway answers with
   *   its own host candidates
   * @param {number} [options.gatherTimeoutMs]  how long to wait for ICE candidates before
   *   sending the offer anyway (the gateway takes no trickled candidates)
   */
  constructor({ baseUrl = "", apiKey = "", iceServers = [], gatherTimeoutMs = 3000 } = {}) {
    super();
    this.baseUrl = baseUrl.replace(/\/+$/, "");
    this.apiKey = apiKey;
    this.iceServers = iceServers;
    this.gatherTimeoutMs = gatherTimeoutMs;
    this.pc = null;
    this.channel = null;
    this.callId = null;
    this.callUrl = null;
    this.remoteStream = null;
    this._state = "idle";
    this._closing = false;
    this._sender = null;
  }

  /** "idle", "connecting", "connected", "interrupted" (the network dropped; ICE may recover),
   * "closed" or "failed". */
  get state() {
    return this._state;
  }

  _setState(state, reason = "") {
    if (this._state === state) return;
    this._state = state;
    this.dispatchEvent(new CustomEvent("state", { detail: { state, reason } }));
  }

  _headers(extra = {}) {
    const headers = { ...extra };
    if (this.apiKey) headers.Authorization = `Bearer ${this.apiKey}`;
    return headers;
  }

  /** Start the call with `microphone` (a MediaStream with an audio track; the caller keeps
   * owning it). Resolves when the data channel is open; rejects with a CallError. */
  async connect(microphone) {
    if (this._state === "connecting" || this._state === "connected") {
      throw new CallError(`Cannot connect: the call is already ${this._state}.`);
    }
    const track = microphone?.getAudioTracks()[0];
    if (!track) throw new CallError("Cannot connect without a microphone audio track.");
    this._setState("connecting");
    const pc = new RTCPeerConnection({ iceServers: this.iceServers });
    this.pc = pc;
    try {
      this._sender = pc.addTransceiver(track, {
        direction: "sendrecv",
        streams: [microphone],
      }).sender;
      pc.addEventListener("track", (e) => {
        this.remoteStream = e.streams[0] ?? new MediaStream([e.track]);
        this.dispatchEvent(new CustomEvent("track", { detail: this.remoteStream }));
      });
      pc.addEventListener("connectionstatechange", () => this._onConnectionState());
      const channel = pc.createDataChannel(EVENTS_CHANNEL);
      this.channel = channel;
      channel.addEventListener("message", (e) => this._onMessage(e.data));
      channel.addEventListener("close", () => {
        if (this._closing) return;
        if (this._state === "connected" || this._state === "interrupted") {
          this._end("closed", "the gateway ended the call");
        }
      });
      const opened = new Promise((resolve, reject) => {
        channel.addEventListener("open", resolve, { once: true });
        pc.addEventListener("connectionstatechange", () => {
          if (pc.connectionState === "failed") reject(new CallError("ICE/DTLS connection failed"));
        });
      });
      await pc.setLocalDescription(await pc.createOffer());
      await this._gathered();
      const answer = await this._postOffer(pc.localDescription.sdp);
      if (this._state !== "connecting") {
        throw new CallError("The call was closed while connecting.");
      }
      await pc.setRemoteDescription({ type: "answer", sdp: answer });
      await withTimeout(opened, 15000, "the event channel did not open within 15 s");
      this._setState("connected");
    } catch (err) {
      const error = err instanceof CallError ? err : new CallError(err?.message ?? String(err));
      this._teardown();
      if (this.callUrl) this._hangUp(this.callUrl); // the gateway may have set the call up
      if (this._state !== "closed") this._setState("failed", error.message);
      throw error;
    }
  }

  _gathered() {
    const pc = this.pc;
    if (pc.iceGatheringState === "complete") return Promise.resolve();
    return new Promise((resolve) => {
      const timer = setTimeout(resolve, this.gatherTimeoutMs);
      pc.addEventListener("icegatheringstatechange", () => {
        if (pc.iceGatheringState === "complete") {
          clearTimeout(timer);
          resolve();
        }
      });
    });
  }

  async _postOffer(sdp) {
    let response;
    try {
      response = await fetch(this.baseUrl + CALLS_PATH + OMNI_EVENTS, {
        method: "POST",
        body: sdp,
        headers: this._headers({ "Content-Type": "application/sdp" }),
      });
    } catch (err) {
      throw new CallError(`The gateway could not be reached: ${err.message}`);
    }
    const text = await response.text();
    if (response.status !== 201 && response.status !== 200) {
      throw callErrorFrom(response, text);
    }
    const location = response.headers.get("Location");
    if (location) {
      this.callUrl = new URL(location, response.url).href;
      this.callId = location.split("/").pop();
    }
    return text;
  }

  _onMessage(data) {
    let event;
    try {
      event = JSON.parse(data);
    } catch {
      const start = String(data).slice(0, 80);
      this._error(new Error(`the gateway sent an event that is not JSON: ${start}`));
      return;
    }
    event.receivedAt = performance.now();
    if (event.type === "session.created" && event.session?.id) this.callId ??= event.session.id;
    this.dispatchEvent(new CustomEvent("event", { detail: event }));
    if (typeof event.type === "string") {
      this.dispatchEvent(new CustomEvent(event.type, { detail: event }));
    }
  }

  _onConnectionState() {
    const s = this.pc?.connectionState;
    const up = this._state === "connected" || this._state === "interrupted";
    if (!up || this._closing) return; // connect() handles failures while connecting
    if (s === "failed") {
      this._error(new CallError("the connection to the gateway failed"));
      this._end("failed", "the connection to the gateway failed");
    } else if (s === "disconnected") {
      this._setState("interrupted", "the network dropped; waiting for it to come back");
    } else if (s === "connected") {
      this._setState("connected", "the network came back");
    }
  }

  _error(error) {
    this.dispatchEvent(new CustomEvent("error", { detail: error }));
  }

  _end(state, reason) {
    this._teardown();
    this._setState(state, reason);
  }

  /** Send a client event (e.g. {type: "response.cancel"}); false when the channel is not open. */
  send(event) {
    if (this.channel?.readyState !== "open") return false;
    this.channel.send(JSON.stringify(event));
    return true;
  }

  /** Speak through another microphone without renegotiating. */
  async replaceMicrophone(microphone) {
    const track = microphone?.getAudioTracks()[0];
    if (!this._sender || !track) return;
    await this._sender.replaceTrack(track);
  }

  /** The audio RTP statistics: {inbound, outbound, roundTripMs}; inbound is the agent's audio
   * as received (bytesReceived, packetsReceived, packetsLost, jitter, audioLevel, ...). */
  async audioStats() {
    const result = { inbound: null, outbound: null, roundTripMs: null };
    if (!this.pc) return result;
    const report = await this.pc.getStats();
    report.forEach((s) => {
      if (s.kind !== "audio" && s.type !== "candidate-pair") return;
      if (s.type === "inbound-rtp") result.inbound = { ...s };
      else if (s.type === "outbound-rtp") result.outbound = { ...s };
      else if (s.type === "candidate-pair" && s.nominated && s.currentRoundTripTime != null) {
        result.roundTripMs = s.currentRoundTripTime * 1000;
      }
    });
    return result;
  }

  /** Hang up: tell the gateway (POST .../hangup on the call's URL), then close the connection.
   * Safe to call twice, and from `pagehide` (the request outlives the page). */
  async close() {
    if (this._state === "idle" || this._state === "closed" || this._closing) return;
    this._closing = true;
    const url = this.callUrl;
    const wasUp = ["connecting", "connected", "interrupted"].includes(this._state);
    try {
      // hang up before closing the connection: closing first races the hang-up (a 404)
      if (url && wasUp) await this._hangUp(url);
    } finally {
      this._teardown();
      this._setState("closed", "hung up");
      this._closing = false;
    }
  }

  async _hangUp(url) {
    try {
      // the GA API's hang-up; omni-gateway also takes DELETE on the call's URL
      await fetch(`${url}/hangup`, { method: "POST", headers: this._headers(), keepalive: true });
    } catch {
      // the peer connection's close reaches the gateway anyway
    }
  }

  _teardown() {
    const pc = this.pc;
    this.pc = null;
    this.channel = null;
    this._sender = null;
    if (pc) pc.close();
  }
}

function callErrorFrom(response, text) {
  let message = `${response.status} ${response.statusText}`.trim();
  let code = null;
  try {
    const body = JSON.parse(text);
    if (body?.error?.message) message = `${body.error.message} (HTTP ${response.status})`;
    code = body?.error?.code ?? null;
  } catch {
    if (text) message += `: ${text.slice(0, 200)}`;
  }
  const retry = Number.parseFloat(response.headers.get("Retry-After") ?? "");
  const retryAfterS = Number.isFinite(retry) ? retry : null;
  if (response.status === 401 || response.status === 403) {
    message = `The gateway refused the API key: ${message}`;
  } else if (response.status === 503 && retryAfterS !== null) {
    message += ` Try again in ${retryAfterS} s.`;
  }
  return new CallError(message, { status: response.status, code, retryAfterS });
}

function withTimeout(promise, ms, message) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new CallError(message)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}
