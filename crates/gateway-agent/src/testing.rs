//! Fixtures shared by unit tests, integration tests, benchmarks and the demo.

use std::sync::Arc;

use crate::{Config, DiscardSink, Engine, UsageSink};

/// The demo's embedded rules: an LLM tenant layout with an org ceiling over per-key
/// limits, three token dimensions, concurrency and a shadow rule.
pub const DEMO_RULES: &str = r#"
[engine]
max_keys = 100_000
max_leases = 65_536

[[rule]]
name = "org-rpm"
match = { org = "*" }
dimension = "requests"
rate = 600
per = "minute"
burst = 100

[[rule]]
name = "org-input-tpm"
match = { org = "*" }
dimension = "input_tokens"
rate = 2_000_000
per = "minute"
burst = 200_000

[[rule]]
name = "key-input-tpm"
parent = "org-input-tpm"
match = { org = "*", key = "*" }
dimension = "input_tokens"
rate = 500_000
per = "minute"
burst = 60_000

[[rule]]
name = "org-output-tpm"
match = { org = "*" }
dimension = "output_tokens"
rate = 400_000
per = "minute"
burst = 50_000
max_output_tokens_default = 512
max_output_tokens_cap = 4_096

[[rule]]
name = "org-concurrency"
match = { org = "*" }
dimension = "concurrency"
max_in_flight = 64

[[rule]]
name = "org-total-tpm-shadow"
match = { org = "*" }
dimension = "total_tokens"
rate = 1_500_000
per = "minute"
mode = "shadow"
"#;

/// Three rate rules (requests, input tokens, output tokens) on one `org` key: the
/// shape of the 3-dimension admit benchmark.
pub const THREE_DIMENSIONS: &str = r#"
[engine]
unmatched = "reject"

[[rule]]
name = "rpm"
match = { org = "*" }
dimension = "requests"
rate = 1_000_000_000
per = "second"

[[rule]]
name = "itpm"
match = { org = "*" }
dimension = "input_tokens"
rate = 1_000_000_000
per = "second"

[[rule]]
name = "otpm"
match = { org = "*" }
dimension = "output_tokens"
rate = 1_000_000_000
per = "second"
"#;

/// An engine over `toml`, discarding usage records. Panics on an invalid config (a
/// fixture bug).
pub fn engine(toml: &str) -> Arc<Engine> {
    engine_with_sink(toml, Arc::new(DiscardSink))
}

/// An engine over `toml` with the given sink.
pub fn engine_with_sink(toml: &str, sink: Arc<dyn UsageSink>) -> Arc<Engine> {
    Arc::new(Engine::new(
        Config::from_toml(toml).expect("fixture config is valid"),
        sink,
    ))
}
