// The conversation as the gateway's Realtime events describe it: the caller's turns (partial,
// then final transcripts), the agent's replies (transcript, speaking, completed or cut by a
// barge-in) and each turn's latencies. No DOM here: a page renders `entries` on "change".
//
// Latencies: the gateway measures turn latency and time to first audio
// (omni.response.first_audio) and cancel latency, CANCEL to the last stage's ack
// (omni.response.cancelled); without those events the same figures are estimated from event
// arrival times (performance.now()), where the events' network delay cancels out of each
// difference. `audioSilentAt(t)` adds what only the client can see: when the agent's voice
// actually stopped arriving after a barge-in.

/** @typedef {{kind: "user", id: string, partial: string, transcript: string|null,
 *   state: "speaking"|"transcribing"|"done", t: Record<string, number>}} UserTurn */
/** @typedef {{kind: "agent", id: string, itemId: string|null, text: string,
 *   heard: string|null, heardMs: number|null,
 *   state: "thinking"|"speaking"|"generated"|"done"|"cut"|"failed", userItemId: string|null,
 *   cutBy: string|null, t: Record<string, number>, latency: Record<string, number>,
 *   measuredBy: Record<string, "server"|"client">}} AgentTurn */

// a cut and the caller's speech_started closer than this are one barge-in
const BARGE_IN_WINDOW_MS = 250;

export class Conversation extends EventTarget {
  constructor() {
    super();
    /** @type {(UserTurn|AgentTurn)[]} in the order they began */
    this.entries = [];
    this.userSpeaking = false;
    this.agentSpeaking = false;
    this.sessionId = null;
    this.errors = [];
    this._users = new Map();
    this._agents = new Map();
    this._lastCommitted = null; // the caller's turn the next reply answers
    this._pendingStop = null; // a cut reply whose audio the client has not yet heard stop
    this._lastCut = null; // the reply cut last, until a speech_started says why
    this._byItem = new Map(); // assistant item id -> reply
  }

  /** The reply whose conversation item is `itemId`, or undefined. */
  replyOfItem(itemId) {
    return this._byItem.get(itemId);
  }

  /** Feed one server event (with `receivedAt`, as RealtimeClient adds). */
  apply(event) {
    const t = event.receivedAt ?? performance.now();
    const handler = HANDLERS[event.type];
    if (!handler) return;
    const changed = handler.call(this, event, t);
    if (changed !== false) this._changed(changed ?? null);
  }

  /** The agent's voice, as the client hears it, fell silent at `t` (performance.now()). */
  audioSilentAt(t) {
    const reply = this._pendingStop;
    if (!reply) return;
    this._pendingStop = null;
    // silence that began before the barge-in (a pause between phrases) counts as 0
    reply.latency.audioStopMs = Math.max(0, t - reply.t.bargeIn);
    reply.measuredBy.audioStopMs = "client";
    this._changed(reply);
  }

  /** The newest turn that has a latency figure, or null. */
  lastMeasured() {
    for (let i = this.entries.length - 1; i >= 0; i--) {
      const e = this.entries[i];
      if (e.kind === "agent" && Object.keys(e.latency).length) return e;
    }
    return null;
  }

  _changed(entry) {
    this.dispatchEvent(new CustomEvent("change", { detail: entry }));
  }

  _user(itemId, t) {
    let turn = this._users.get(itemId);
    if (!turn) {
      turn = {
        kind: "user",
        id: itemId,
        partial: "",
        transcript: null,
        state: "speaking",
        t: { created: t },
      };
      this._users.set(itemId, turn);
      this.entries.push(turn);
    }
    return turn;
  }

  _agent(responseId, t) {
    let reply = this._agents.get(responseId);
    if (!reply) {
      reply = {
        kind: "agent",
        id: responseId,
        itemId: null,
        text: "",
        heard: null,
        heardMs: null,
        state: "thinking",
        userItemId: this._lastCommitted,
        cutBy: null,
        t: { created: t },
        latency: {},
        measuredBy: {},
      };
      this._lastCommitted = null;
      this._agents.set(responseId, reply);
      this.entries.push(reply);
    }
    return reply;
  }

  _speakingReply() {
    for (let i = this.entries.length - 1; i >= 0; i--) {
      const e = this.entries[i];
      if (e.kind === "agent" && (e.state === "speaking" || e.state === "generated")) return e;
    }
    return null;
  }

  _link(reply, itemId) {
    if (!itemId || reply.itemId) return;
    reply.itemId = itemId;
    this._byItem.set(itemId, reply);
  }

  /** Set a latency figure; the gateway's own figure wins over the client's estimate. */
  _latency(reply, key, ms, by) {
    if (ms === undefined || ms === null || Number.isNaN(ms)) return;
    if (by === "client" && reply.measuredBy[key] === "server") return;
    reply.latency[key] = ms;
    reply.measuredBy[key] = by;
  }

  _measure(reply) {
    const { t } = reply;
    const user = reply.userItemId ? this._users.get(reply.userItemId) : null;
    if (t.audioStarted !== undefined) {
      this._latency(reply, "firstAudioMs", t.audioStarted - t.created, "client");
      if (user?.t.speechStopped !== undefined) {
        this._latency(reply, "turnMs", t.audioStarted - user.t.speechStopped, "client");
      }
    }
    if (user?.t.speechStopped !== undefined && user.t.transcribed !== undefined) {
      this._latency(reply, "transcriptMs", user.t.transcribed - user.t.speechStopped, "client");
    }
  }

  _cut(reply, t) {
    if (reply.state === "cut") return;
    reply.state = "cut";
    reply.cutBy ??= "cancelled";
    reply.t.cut = t;
    this.agentSpeaking = false;
    this._lastCut = reply;
    if (reply.t.bargeIn !== undefined) this._bargeIn(reply);
  }

  _bargeIn(reply) {
    reply.cutBy = "turn_detected";
    if (reply.t.audioStarted !== undefined) this._pendingStop = reply;
  }
}

const HANDLERS = {
  "session.created"(e) {
    this.sessionId = e.session?.id ?? null;
  },

  "input_audio_buffer.speech_started"(e, t) {
    this.userSpeaking = true;
    const turn = this._user(e.item_id, t);
    turn.t.speechStarted = t;
    // the gateway cuts the reply at the caller's speech onset, and says so just before (or
    // after) speech_started: the earlier of the two is the barge-in's moment
    const cut = this._lastCut;
    if (cut && cut.t.bargeIn === undefined && t - cut.t.cut <= BARGE_IN_WINDOW_MS) {
      cut.t.bargeIn = cut.t.cut;
      this._bargeIn(cut);
      this._changed(cut);
    } else {
      const playing = this._speakingReply();
      if (playing) playing.t.bargeIn = t;
    }
    return turn;
  },

  "input_audio_buffer.speech_stopped"(e, t) {
    this.userSpeaking = false;
    const turn = this._user(e.item_id, t);
    turn.t.speechStopped = t;
    if (turn.state === "speaking") turn.state = "transcribing";
    return turn;
  },

  "input_audio_buffer.committed"(e) {
    this._lastCommitted = e.item_id;
    return false;
  },

  "conversation.item.input_audio_transcription.delta"(e, t) {
    const turn = this._user(e.item_id, t);
    if (turn.transcript !== null) return false;
    turn.partial += e.delta ?? "";
    return turn;
  },

  "conversation.item.input_audio_transcription.completed"(e, t) {
    const turn = this._user(e.item_id, t);
    turn.transcript = e.transcript ?? "";
    turn.state = "done";
    turn.t.transcribed = t;
    for (const reply of this._agents.values()) {
      if (reply.userItemId === turn.id) this._measure(reply);
    }
    return turn;
  },

  "conversation.item.input_audio_transcription.failed"(e, t) {
    const turn = this._user(e.item_id, t);
    turn.state = "done";
    turn.transcript = turn.partial;
    turn.failed = e.error?.message ?? "transcription failed";
    return turn;
  },

  "response.created"(e, t) {
    return this._agent(e.response?.id, t);
  },

  "response.output_item.added"(e, t) {
    this._link(this._agent(e.response_id, t), e.item?.id);
    return false;
  },

  "response.output_audio_transcript.delta"(e, t) {
    const reply = this._agent(e.response_id, t);
    this._link(reply, e.item_id);
    if (reply.state === "cut") return false; // stragglers of a cut reply
    reply.text += e.delta ?? "";
    if (reply.t.firstText === undefined) reply.t.firstText = t;
    return reply;
  },

  "response.output_audio_transcript.done"(e, t) {
    const reply = this._agent(e.response_id, t);
    if (reply.state !== "cut" && typeof e.transcript === "string") reply.text = e.transcript;
    return reply;
  },

  "output_audio_buffer.started"(e, t) {
    const reply = this._agent(e.response_id, t);
    if (reply.state === "cut") return false;
    this.agentSpeaking = true;
    reply.state = reply.state === "generated" ? "generated" : "speaking";
    reply.t.audioStarted = t;
    this._measure(reply);
    return reply;
  },

  "output_audio_buffer.stopped"(e, t) {
    const reply = this._agent(e.response_id, t);
    this.agentSpeaking = false;
    if (reply.state !== "cut" && reply.state !== "failed") reply.state = "done";
    reply.t.audioStopped = t;
    return reply;
  },

  // the agent's queued audio was dropped: its reply is cut, whether or not it was still being
  // generated (a reply generated in full gets no second response.done)
  "output_audio_buffer.cleared"(e, t) {
    const reply = this._agent(e.response_id, t);
    this._cut(reply, t);
    return reply;
  },

  "conversation.item.truncated"(e, t) {
    const reply = this._byItem.get(e.item_id);
    if (!reply) return false;
    reply.heardMs = e.audio_end_ms ?? null;
    this._cut(reply, t);
    return reply;
  },

  // after a cut, the item holds what the caller heard (the page asks with
  // conversation.item.retrieve; a cancelled response.done says it too)
  "conversation.item.retrieved"(e) {
    const reply = this._byItem.get(e.item?.id);
    if (!reply || reply.state !== "cut") return false;
    const heard = transcriptOfContent(e.item.content);
    if (heard === null) return false;
    reply.heard = heard;
    return reply;
  },

  "omni.response.first_audio"(e, t) {
    const reply = this._agent(e.response_id, t);
    this._latency(reply, "turnMs", e.turn_latency_ms, "server");
    this._latency(reply, "firstAudioMs", e.time_to_first_audio_ms, "server");
    return reply;
  },

  "omni.response.cancelled"(e, t) {
    const reply = this._agent(e.response_id, t);
    this._latency(reply, "cancelMs", e.cancel_latency_ms, "server");
    reply.cancelStagesMs = e.stages_ms ?? null;
    return reply;
  },

  "response.done"(e, t) {
    const r = e.response ?? {};
    const reply = this._agent(r.id, t);
    reply.t.done = t;
    this._link(reply, r.output?.[0]?.id);
    if (r.status === "cancelled") {
      reply.cutBy = r.status_details?.reason ?? "cancelled";
      reply.heard = transcriptOf(r) ?? reply.heard ?? "";
      if (reply.cutBy === "turn_detected") reply.t.bargeIn ??= reply.t.cut ?? t;
      if (reply.state !== "cut") this._cut(reply, t);
      else if (reply.cutBy === "turn_detected") this._bargeIn(reply);
    } else if (r.status === "failed") {
      reply.state = "failed";
      reply.failed = r.status_details?.error?.message ?? r.status;
    } else {
      // "completed", or "incomplete": stopped at the token limit, still a reply to play
      if (r.status === "incomplete") reply.incomplete = r.status_details?.reason ?? "incomplete";
      const text = transcriptOf(r);
      if (text) reply.text = text;
      // generated in full; it is still being spoken until output_audio_buffer.stopped
      if (reply.state === "thinking" || reply.state === "speaking") reply.state = "generated";
    }
    return reply;
  },

  error(e, t) {
    this.errors.push({ message: e.error?.message ?? "unknown error", code: e.error?.code, t });
    return null;
  },
};

function transcriptOf(response) {
  for (const item of response.output ?? []) {
    const text = transcriptOfContent(item.content);
    if (text !== null) return text;
  }
  return null;
}

function transcriptOfContent(content) {
  for (const part of content ?? []) {
    if (typeof part.transcript === "string") return part.transcript;
    if (typeof part.text === "string") return part.text;
  }
  return null;
}
