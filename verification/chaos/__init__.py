"""The deterministic fault simulation (chaos) tester: seeded fault plans driven through the runtime's assembly
and seams."""
