"""Run-time support for generated pipeline packages (nothing from the compiler)."""
