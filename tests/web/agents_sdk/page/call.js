// A RealtimeSession of the OpenAI Agents SDK over WebRTC, as an app served from another
// origin than the gateway's runs it; what its transport receives is kept for the test.
import { RealtimeAgent, RealtimeSession } from "/sdk/openai-realtime-agents.mjs";

window.agentsCall = {
  session: null,
  events: [],
  errors: [],

  async connect({ url, apiKey }) {
    const agent = new RealtimeAgent({ name: "Assistant", instructions: "Answer briefly." });
    // the SDK's defaults, tracing "auto" among them: the gateway takes it (its own traces go
    // where gateway.tracing says)
    const session = new RealtimeSession(agent, { transport: "webrtc" });
    session.on("transport_event", (event) => this.events.push(event));
    session.on("error", (event) => this.errors.push(describe(event.error)));
    this.session = session;
    await session.connect({ apiKey, url });
    const transport = session.transport;
    return { status: transport.status, callId: transport.callId ?? null };
  },

  // the SDK's close() only closes the peer connection: an app that wants the call gone at
  // once hangs it up itself
  async hangUp({ url, apiKey }) {
    const callId = this.session.transport.callId;
    const response = await fetch(`${url}/${callId}`, {
      method: "DELETE",
      headers: { Authorization: `Bearer ${apiKey}` },
    });
    return response.status;
  },

  seen(type) {
    return this.events.filter((event) => event.type === type).length;
  },
};

function describe(error) {
  if (error instanceof Error) return error.message;
  if (error?.type) return `${error.type}: ${JSON.stringify(error.error ?? error)}`;
  return JSON.stringify(error);
}
