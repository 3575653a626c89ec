"""The drafter service's one frozen config, built by the launcher from flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_serve.service_settings import ServiceSettings


@dataclass(frozen=True)
class DrafterServiceConfig:
    model: str
    target_model: str
    service: ServiceSettings = field(default_factory=ServiceSettings)

    def validate(self) -> None:
        self.service.validate("drafter")
