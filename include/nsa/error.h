// The one error type of the library.
//
// Every invalid input is reported as an nsa::Error whose message names the parameter, the value
// it had and what is allowed, e.g.
//   nsa: invalid cmp_stride = 5: must divide cmp_block_len (32) and slc_block_len (64)
// The three parts are also available separately for programs that want to react to them.
#pragma once

#include <stdexcept>
#include <string>

namespace nsa {

class Error : public std::runtime_error {
 public:
  Error(std::string parameter, std::string value, std::string allowed);

  const std::string& parameter() const { return parameter_; }
  const std::string& value() const { return value_; }
  const std::string& allowed() const { return allowed_; }

 private:
  std::string parameter_;
  std::string value_;
  std::string allowed_;
};

}  // namespace nsa
