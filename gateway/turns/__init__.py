"""Turn-taking: when the caller's turn begins and ends, and what their voice over the agent
does. Policy over numbers and models, configured by `gateway.turns`; the call session
(gateway.session) feeds it and carries out what it decides, and nothing here reaches the
session, a transport or the rings.

- `detector`: the turn detector on 20 ms frames (OpenAI's server_vad knobs), over a speech
  classifier from `classifiers` (webrtcvad, or Silero from `silero`);
- `smart_turn`: the sound model semantic_vad asks (Smart Turn v3 on ONNX), off the loop;
- `models`: the classifier and sound models one gateway process loads for all its calls;
- `end_of_turn`: semantic_vad's judge, one a session: at a pause, ended, window or held;
- `interruption`: what a sound over the agent does: cut, pause, resume or nothing;
- `idle`: the idle timeout of server_vad.
"""
