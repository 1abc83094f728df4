"""Python-backend model code, copied into the generated repository (one folder per model)."""
