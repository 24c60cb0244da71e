//! `bursar-agent`: placeholder until the demo lands.
fn main() {}
