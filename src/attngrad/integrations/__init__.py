"""attngrad inside other libraries; each integration needs its library (an extra)."""
