"""One Realtime session, in parts that depend one way:

reply (a reply's states) and spans (their OpenTelemetry trace) <- outbox (the transport and
every server event) <- turns (the caller's audio and turns), intake (a WebSocket's input
formats) and replies (the agent's reply) <- stop (every way a reply is stopped, and the
cancels) <- interruptions (what a sound over the agent does, carried out) and client_events
(the client's) <- call (the coordinator). What to decide about turns is gateway.turns'.
"""

from gateway.session.call import RealtimeSession
from gateway.session.client_events import MAX_EVENT_BYTES
from gateway.session.outbox import Transport
from gateway.session.reply import Reply, ReplyState

__all__ = ["MAX_EVENT_BYTES", "RealtimeSession", "Reply", "ReplyState", "Transport"]
