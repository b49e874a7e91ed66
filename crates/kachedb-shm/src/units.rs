//! Byte counts as people write them: `8GiB`, `512MiB`, `3G` in; `1.5 GiB` out.
//!
//! The notation of `kachedb serve --size`, `--headroom` and the benchmarks'
//! size options, and of the sizes they print.

/// Parses `8GiB`, `512MiB`, `3G`, `100M`, `4096K`, `12345` (bytes). Units are
/// binary and case-insensitive; a fraction (`1.5GiB`) is rounded down to a byte.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num: f64 = num.parse().map_err(|_| format!("{s:?} is not a size: use e.g. 8GiB, 512MiB or a byte count"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        u => return Err(format!("unknown size unit {u:?} in {s:?}: use KiB, MiB, GiB or TiB")),
    };
    Ok((num * mult as f64) as u64)
}

/// `n` bytes as `1.5 GiB`-style text (one decimal; plain `B` below 1 KiB).
pub fn human_bytes(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < units.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", units[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_and_plain_bytes() {
        assert_eq!(parse_size("12345"), Ok(12345));
        assert_eq!(parse_size("4096K"), Ok(4 << 20));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size(" 8gib "), Ok(8 << 30));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert!(parse_size("not-a-size").is_err());
        assert!(parse_size("3 parsecs").unwrap_err().contains("unknown size unit"));
    }

    #[test]
    fn formats_with_binary_units() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 << 29), "1.5 GiB");
        assert_eq!(human_bytes(256 << 20), "256.0 MiB");
    }
}
