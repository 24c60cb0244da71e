//! A number that only grows across restarts, kept in a one-line file: the allocator's
//! term (`--term-file`) and a ledger node's membership generation.
//!
//! Each [`next`] reads the last value, takes one more (or the wall clock in
//! milliseconds, if that is higher: a lost or emptied file does not start the count
//! again at 1), and writes it back through a temporary file, fsynced and renamed, with
//! the directory fsynced, before returning it.

use std::io::Write as _;
use std::path::{Path, PathBuf};

/// Why the counter could not be read or advanced.
#[derive(Debug, thiserror::Error)]
pub enum CounterError {
    /// The file holds something other than a number.
    #[error("{path}: not a number ({text:?})")]
    NotANumber {
        /// The file.
        path: PathBuf,
        /// Its first line, up to 40 characters.
        text: String,
    },
    /// Reading or writing it failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The count reached `u64::MAX`.
    #[error("{0}: the count is at its largest value")]
    Overflow(PathBuf),
}

/// The next value of the counter in `path` (written back, durably, before this
/// returns); `wall_ms` is the floor (the wall clock in ms; see the module docs).
pub fn next_at(path: &Path, wall_ms: u64) -> Result<u64, CounterError> {
    let io = |source| CounterError::Io {
        path: path.to_path_buf(),
        source,
    };
    let last = match std::fs::read_to_string(path) {
        // Emptied (nothing but white space): as lost, the clock is the floor (the
        // module docs). It refused the start before.
        Ok(s) if s.trim().is_empty() => 0,
        Ok(s) => s
            .trim()
            .parse::<u64>()
            .map_err(|_| CounterError::NotANumber {
                path: path.to_path_buf(),
                text: s.lines().next().unwrap_or("").chars().take(40).collect(),
            })?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
        Err(e) => return Err(io(e)),
    };
    let next = last
        .checked_add(1)
        .ok_or_else(|| CounterError::Overflow(path.to_path_buf()))?
        .max(wall_ms);
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        writeln!(f, "{next}").map_err(io)?;
        f.sync_all().map_err(io)?;
    }
    std::fs::rename(&tmp, path).map_err(io)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
        && let Ok(d) = std::fs::File::open(dir)
    {
        let _ = d.sync_all();
    }
    Ok(next)
}

/// [`next_at`] with the wall clock's milliseconds since 1970 as the floor.
pub fn next(path: &Path) -> Result<u64, CounterError> {
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    next_at(path, wall)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_count_grows_at_every_start_even_when_the_clock_steps_back() {
        let dir = std::env::temp_dir().join(format!("bursar-counter-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("generation");
        let _ = std::fs::remove_file(&p);
        assert_eq!(
            next_at(&p, 1_000).unwrap(),
            1_000,
            "a new file starts at the clock"
        );
        assert_eq!(
            next_at(&p, 500).unwrap(),
            1_001,
            "a clock stepped back: one more"
        );
        assert_eq!(
            next_at(&p, 5_000).unwrap(),
            5_000,
            "the clock ahead: the clock"
        );
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "5000\n");
        std::fs::write(&p, " \n").unwrap();
        assert_eq!(
            next_at(&p, 7_000).unwrap(),
            7_000,
            "an emptied file: the clock"
        );
        std::fs::write(&p, "garbage\n").unwrap();
        let e = next_at(&p, 1).unwrap_err();
        assert!(e.to_string().contains("not a number"), "{e}");
        std::fs::write(&p, format!("{}\n", u64::MAX)).unwrap();
        assert!(matches!(next_at(&p, 1), Err(CounterError::Overflow(_))));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
