//! `bursar-ledger`: the ledger node. Its HTTP shell is not built yet; this binary only
//! says so and exits with an error.

fn main() {
    eprintln!("bursar-ledger: the HTTP shell is not built yet");
    std::process::exit(2);
}
