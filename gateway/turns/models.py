"""The models a gateway process's calls share for their turns: Silero VAD when it is the
configured classifier, and the sound model semantic_vad asks. Both load as the process starts
(a few hundred milliseconds), not on a call's first use, which would hold the loop.

Loading them keeps the process's BLAS (numpy's OpenBLAS) to one thread. The end-of-turn
features' mel projection is a matrix product; left alone, OpenBLAS runs it on a thread per
core, and those threads spin on through the rest of the prediction: on a 2-core machine a
prediction took 54 ms of CPU for 26 ms of wall time, against 31 for 31 on one thread, and on a
many-core host every gateway process's predictions take every core while they run, from the
stages. The gateway's own numpy work is small: one thread is what it needs.
"""

from __future__ import annotations

import logging

from gateway.config import TurnsConfig
from gateway.fields import ProtocolError
from gateway.protocol import SessionConfig
from gateway.turns.classifiers import SileroClassifier, SpeechClassifier, WebrtcClassifier
from gateway.turns.silero import SileroModel
from gateway.turns.smart_turn import SmartTurn, SmartTurnModel
from stages.backends import bundled

logger = logging.getLogger(__name__)


class TurnModels:
    def __init__(self, config: TurnsConfig) -> None:
        from threadpoolctl import threadpool_limits

        threadpool_limits(1, user_api="blas")  # for the whole process: see the module's note
        self.config = config
        self.silero: SileroModel | None = None
        if config.vad.classifier == "silero":
            self.silero = SileroModel(bundled.resolve(config.vad.silero_model))
            logger.info("voice activity: Silero VAD (%s)", config.vad.silero_model)
        self.end_of_turn: SmartTurn | None = None
        self.end_of_turn_missing: str | None = None
        model = config.end_of_turn.model
        try:
            self.end_of_turn = SmartTurn(SmartTurnModel(bundled.resolve(model)))
        except (bundled.BundledModelMissing, FileNotFoundError) as exc:
            if config.detection.type == "semantic_vad":
                raise
            self.end_of_turn_missing = str(exc)  # semantic_vad is refused, naming it
            logger.warning("semantic_vad is off: %s", exc)
        else:
            logger.info("end of turn: %s", model)

    def classifier(self, threshold: float) -> SpeechClassifier:
        """A new call's per-frame classifier."""
        if self.silero is not None:
            return SileroClassifier(self.silero, threshold)
        return WebrtcClassifier(threshold)

    def check(self, config: SessionConfig, param: str = "session") -> None:
        """Refuse settings this process has no model for."""
        td = config.turn_detection
        if td is not None and td.semantic and self.end_of_turn is None:
            where = f"{param}.audio.input.turn_detection.type"
            raise ProtocolError(
                f"{where}='semantic_vad' needs the end-of-turn model: {self.end_of_turn_missing}",
                param=where,
                code="unsupported",
            )

    def close(self) -> None:
        if self.end_of_turn is not None:
            self.end_of_turn.close()
