"""Reports: a record's books as Markdown, single-file HTML and JSON, and static sites."""

from reward_lens.report.build import build_report
from reward_lens.report.model import SCHEMA_VERSION, Report
from reward_lens.report.render import to_html, to_json, to_markdown

__all__ = ["SCHEMA_VERSION", "Report", "build_report", "to_html", "to_json", "to_markdown"]
