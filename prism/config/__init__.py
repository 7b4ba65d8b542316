"""Typed configs, one per concern or stage, each field declaring its flag once
(prism.config.flags): the CLI's parsers, the launcher's stage command lines and
`prism deploy kubernetes` are all written from them, so that a flag has one home."""
