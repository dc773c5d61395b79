"""Jinja2 templates of the code ``ftcompile compile`` generates (installed as ftcompile.codegen_templates)."""
