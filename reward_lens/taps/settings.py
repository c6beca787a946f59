"""The tap's settings model, kept where the user imports it from (``reward_lens.taps.settings``):
it lives in the spec layer (``reward_lens_spec.tap_settings``), which the audit below the taps
reads too, so that the audit validates a config's ``reward_lens:`` section without importing
the taps."""

from reward_lens_spec.tap_settings import TapSettings, TapTarget, settings_error, tap_settings

__all__ = ["TapSettings", "TapTarget", "settings_error", "tap_settings"]
