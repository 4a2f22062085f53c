//! How step outputs travel between processes: each output as `u64` words behind a small header
//! (`[step, present, length]`), and every rank's words gathered in two all-gathers (the lengths,
//! then the words padded to the longest).

use crate::error::{DdpError, Result};

/// One entry of the words a rank sends: `[step, present, length, words of the output...]`.
///
/// # Errors
/// `encode`'s (an output tensor that cannot be read); `words` is left as it was.
pub(super) fn encode_entry<T>(
    words: &mut Vec<u64>,
    step: usize,
    output: Option<&T>,
    encode: fn(&T, &mut Vec<u64>) -> std::result::Result<(), String>,
) -> std::result::Result<(), String> {
    let start = words.len();
    words.push(step as u64);
    match output {
        Some(output) => {
            words.push(1);
            let at = words.len();
            words.push(0);
            if let Err(err) = encode(output, words) {
                words.truncate(start);
                return Err(err);
            }
            words[at] = (words.len() - at - 1) as u64;
        }
        None => {
            words.push(0);
            words.push(0);
        }
    }
    Ok(())
}

/// The entry [`encode_entry`] wrote at the front of `words`.
pub(super) fn decode_entry<T, D>(
    words: &mut &[u64],
    decode: fn(&mut &[u64], &D) -> std::result::Result<T, String>,
    device: &D,
) -> std::result::Result<(usize, Option<T>), String> {
    let [step, present, length] = match words {
        [a, b, c, ..] => [*a, *b, *c],
        _ => return Err("an entry header is cut short".into()),
    };
    let rest = &words[3..];
    let length = length as usize;
    if rest.len() < length {
        return Err(format!("an entry of {length} words, {} left", rest.len()));
    }
    let (mut body, after) = rest.split_at(length);
    *words = after;
    let output = if present != 0 {
        let output = decode(&mut body, device)?;
        if !body.is_empty() {
            return Err(format!("{} words left after an output", body.len()));
        }
        Some(output)
    } else {
        None
    };
    Ok((step as usize, output))
}

/// Every rank's `words` (of any length), in rank order: two all-gathers (the lengths, then the
/// words padded to the longest).
pub(super) fn gather_words(
    group: &dyn burn_ddp_comm::group::ProcessGroup,
    words: Vec<u64>,
    timeout: std::time::Duration,
) -> Result<Vec<Vec<u64>>> {
    let lengths = group.all_gather(&[words.len() as u64], timeout)?;
    let longest = lengths.iter().copied().max().unwrap_or(0) as usize;
    if longest == 0 {
        return Ok(vec![Vec::new(); lengths.len()]);
    }
    let mut padded = words;
    padded.resize(longest, 0);
    let all = group.all_gather(&padded, timeout)?;
    Ok(all
        .chunks(longest)
        .zip(&lengths)
        .map(|(chunk, &len)| chunk[..len as usize].to_vec())
        .collect())
}

pub(super) fn bad_words(rank: usize, from: usize, detail: String) -> DdpError {
    DdpError::Bucket {
        rank,
        bucket: 0,
        detail: format!(
            "the step outputs rank {from} sent for the metrics cannot be read: {detail}"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(value: &u64, words: &mut Vec<u64>) -> std::result::Result<(), String> {
        words.extend([*value, value + 1]);
        Ok(())
    }

    fn unreadable(_: &u64, words: &mut Vec<u64>) -> std::result::Result<(), String> {
        words.push(99);
        Err("the device is gone".into())
    }

    fn decode(words: &mut &[u64], offset: &u64) -> std::result::Result<u64, String> {
        match words {
            [a, b, rest @ ..] if *b == a + 1 => {
                let value = *a + offset;
                *words = rest;
                Ok(value)
            }
            _ => Err("not a pair".into()),
        }
    }

    #[test]
    fn entries_round_trip_and_bad_words_are_errors() {
        let mut words = Vec::new();
        encode_entry(&mut words, 3, Some(&7), encode).unwrap();
        encode_entry::<u64>(&mut words, 4, None, encode).unwrap();
        // A failed read leaves the words as they were.
        let before = words.clone();
        assert!(encode_entry(&mut words, 5, Some(&1), unreadable).is_err());
        assert_eq!(words, before);

        let mut rest = words.as_slice();
        assert_eq!(decode_entry(&mut rest, decode, &100), Ok((3, Some(107))));
        assert_eq!(decode_entry(&mut rest, decode, &100), Ok((4, None)));
        assert!(rest.is_empty());

        // Cut short, an overlong length, words left over: errors naming what is wrong.
        let mut short: &[u64] = &words[..2];
        assert!(
            decode_entry(&mut short, decode, &0)
                .unwrap_err()
                .contains("cut short")
        );
        let mut long: &[u64] = &[1, 1, 10, 7, 8];
        assert!(
            decode_entry(&mut long, decode, &0)
                .unwrap_err()
                .contains("10 words")
        );
        let mut extra: &[u64] = &[1, 1, 3, 7, 8, 0];
        assert!(
            decode_entry(&mut extra, decode, &0)
                .unwrap_err()
                .contains("left after")
        );
    }
}
